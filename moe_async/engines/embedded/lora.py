"""LoRA adapters in the embedded engine, as SGLang 0.5.23 serves them (``--enable-lora``):
adapters in PEFT format loaded under a name, chosen per request by ``lora_path``.

Data path of one forward: the scheduler sets :attr:`EngineLora.rows` (each batch row's adapter
name or None) -> a forward hook on every adapted ``nn.Linear`` adds
``scaling * B (A x)`` to the rows of each adapter -> routed experts (transformers' fused
``mlp.experts`` parameters ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``) run an
eager per-expert loop that adds each token's adapter to ``gate_up`` and ``down``. PEFT layouts
(``peft.tuners.lora.layer.ParamWrapper``): expert ``lora_A [E*r, in]`` expert-major,
``lora_B [out, r*E]`` with expert ``e``'s column ``j`` at ``j*E + e``.

Versions: an adapter is held by each request that uses it (:meth:`acquire` / :meth:`release`);
:meth:`unload` of a held adapter only marks it, and it leaves when its last request finishes,
so an unload never waits for (or aborts) a request in flight. A received bucket is not copied:
the adapter's tensors view the sender's shared memory (:attr:`EngineAdapter.sender`), as
SGLang's keep the tensors they were given, until the adapter is unloaded; one unloaded while
requests still hold it is first copied out of that memory (the sender may reuse it then).
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from moe_async.engines.embedded.sampling import RequestError
from moe_async.types import JsonDict

Tensor = torch.Tensor
PEFT_PREFIX = "base_model.model."


class LoraError(RequestError):
    """A bad adapter (name, config, tensor) or a request naming an adapter that is not loaded."""


@dataclass
class EngineAdapter:
    """One loaded adapter: ``linear[module] = (A [r, in], B [out, r])``;
    ``experts[module][param] = (A [E, r, in], B [E, out, r])``; ``scaling`` = alpha / r."""

    name: str
    scaling: float
    linear: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    experts: dict[str, dict[str, tuple[Tensor, Tensor]]] = field(default_factory=dict)
    holders: int = 0
    unloading: bool = False
    #: the sender's bucket (shared memory) the tensors view, or None: theirs until unloaded
    sender: Tensor | None = None

    def views(self, buf: Tensor) -> bool:
        """Some tensor of the adapter lies in ``buf``'s storage."""
        base = buf.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == base for t in self._tensors())

    def viewed_by_all(self, buf: Tensor) -> bool:
        """Every tensor of the adapter lies in ``buf``'s storage (none is a copy)."""
        base = buf.untyped_storage().data_ptr()
        return all(t.untyped_storage().data_ptr() == base for t in self._tensors())

    def renamed(self, name: str) -> EngineAdapter:
        """A new adapter ``name`` with this one's scaling and tensors (the same tensor objects,
        in dicts of its own), no holders, not unloading."""
        return EngineAdapter(name, self.scaling, dict(self.linear), {p: dict(d) for p, d in self.experts.items()},
                             sender=self.sender)

    def _tensors(self) -> list[Tensor]:
        ts = [t for a, b in self.linear.values() for t in (a, b)]
        return ts + [t for d in self.experts.values() for a, b in d.values() for t in (a, b)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())


def parse_peft(name: str, config: JsonDict, tensors: dict[str, Tensor], model: torch.nn.Module,
               dtype: torch.dtype, modules: dict[str, torch.nn.Module] | None = None) -> EngineAdapter:
    """PEFT ``adapter_config.json`` + ``adapter_model.safetensors`` tensors -> an adapter for ``model``
    (``modules``: ``dict(model.named_modules())`` if the caller has it). The adapter's tensors are
    views of ``tensors`` where those are contiguous and in ``dtype`` (the experts' ``B`` a strided
    view ``[E, out, r]`` of PEFT's ``[out, r*E]``), else copies.

    Raises:
        LoraError: an unsupported config field (DoRA, rsLoRA is taken, bias, dropout is ignored at
            inference), a tensor whose module is not in the model or whose shape does not fit it,
            a module with lora_A but no lora_B; each naming the tensor or field.
    """
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"adapter {name!r}: peft_type {config.get('peft_type')!r}, only LORA")
    if config.get("use_dora"):
        raise LoraError(f"adapter {name!r}: use_dora is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise LoraError(f"adapter {name!r}: LoRA bias is not supported")
    for key in ("alpha_pattern", "rank_pattern", "modules_to_save"):
        if config.get(key):
            raise LoraError(f"adapter {name!r}: {key}={config[key]!r} is not supported (one r and lora_alpha for every module)")
    try:
        r, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as e:
        raise LoraError(f"adapter {name!r}: adapter config needs r and lora_alpha ({e})") from None
    if r < 1 or r != config["r"]:
        raise LoraError(f"adapter {name!r}: r={config['r']!r} must be a positive integer")
    if not math.isfinite(alpha):
        raise LoraError(f"adapter {name!r}: lora_alpha={config['lora_alpha']!r} must be finite")
    scaling = alpha / (r ** 0.5) if config.get("use_rslora") else alpha / r
    if not _all_finite(list(tensors.values())):
        for key in sorted(tensors):
            if not is_finite(tensors[key]):
                raise LoraError(f"adapter {name!r}: tensor {key} holds non-finite values")
    params = list(config.get("target_parameters") or [])
    modules = modules if modules is not None else dict(model.named_modules())
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, t in tensors.items():
        m = re.match(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.default)?\.weight$", key)
        if m is None:
            raise LoraError(f"adapter {name!r}: tensor {key!r} is not a PEFT lora_A/lora_B weight")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    ad = EngineAdapter(name, scaling)
    for path, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoraError(f"adapter {name!r}: {path} has {sorted(ab)} only")
        A, B = ab["lora_A"], ab["lora_B"]
        if A.dtype != dtype or B.dtype != dtype:
            A, B = A.to(dtype), B.to(dtype)
        depth = 0
        base = path
        while base.endswith(".base_layer"):
            base, depth = base[: -len(".base_layer")], depth + 1
        mod = modules.get(base)
        if mod is None:
            raise LoraError(f"adapter {name!r}: tensor {PEFT_PREFIX}{path}.lora_A.weight: the model has no module {base!r}")
        if isinstance(mod, torch.nn.Linear):
            if A.shape != (r, mod.in_features) or B.shape != (mod.out_features, r):
                raise LoraError(f"adapter {name!r}: {path}: lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)} do not fit "
                                f"Linear({mod.in_features}, {mod.out_features}) at r={r}")
            ad.linear[base] = (A.contiguous(), B.contiguous())
            continue
        # fused experts: PEFT nests one wrapper per target parameter; which parameter a nesting
        # level adapts is told by the shapes (target_parameters is a set in PEFT: its saved
        # order varies with the hash seed), by the order only where the shapes cannot tell
        mine = [p.rsplit(".", 1)[1] for p in params if base.endswith("." + p.rsplit(".", 1)[0]) or base == p.rsplit(".", 1)[0]]
        if not mine or depth >= len(mine):
            raise LoraError(f"adapter {name!r}: {path}: not a Linear and no target_parameters entry names it")
        fits = [q for q in mine if _fits_expert(getattr(mod, q, None), A, B, r)]
        pname = fits[0] if len(fits) == 1 else mine[len(mine) - 1 - depth]
        if pname in ad.experts.get(base, {}):
            raise LoraError(f"adapter {name!r}: {path}: a second adapter for {base}.{pname}")
        W = getattr(mod, pname, None)
        if not isinstance(W, torch.Tensor) or W.dim() != 3:
            raise LoraError(f"adapter {name!r}: {base}.{pname} is not a 3-D expert parameter")
        E, out, inn = W.shape
        if A.shape != (E * r, inn) or B.shape != (out, r * E):
            raise LoraError(f"adapter {name!r}: {path}: lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)} do not fit "
                            f"{base}.{pname} {tuple(W.shape)} at r={r}")
        # B stays in PEFT's layout (column j*E + e): expert e's [out, r] is a strided view, no copy
        ad.experts.setdefault(base, {})[pname] = (A.contiguous().reshape(E, r, inn),
                                                  B.contiguous().reshape(out, r, E).permute(2, 0, 1))
    if not ad.linear and not ad.experts:
        raise LoraError(f"adapter {name!r}: no lora_A/lora_B tensors")
    return ad


def is_finite(t: Tensor) -> bool:
    """No NaN or inf in ``t``, with no temporary of ``t``'s size (unlike ``isfinite(t).all()``):
    a finite sum proves it (a NaN or inf element makes the sum NaN or inf; one pass, ~1.6x
    faster than ``aminmax`` on a CPU); a sum that is not finite (such an element, or finite
    values overflowing) is settled by ``aminmax``, which propagates NaN and shows +-inf."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    if math.isfinite(float(t.sum())):
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def _all_finite(ts: list[Tensor]) -> bool:
    """No NaN or inf in any of ``ts`` (:func:`finite_spans`, one :func:`is_finite` each)."""
    return all(is_finite(t) for t in finite_spans(ts))


def finite_spans(ts: list[Tensor]) -> list[Tensor]:
    """What a finiteness check of ``ts`` reads: one view over their bytes when they lie end to
    end in one storage in one dtype (a received bucket), else the non-empty tensors."""
    from moe_async.weight_sync.packing import contiguous_span

    ts = [t for t in ts if t.numel()]
    if ts and all(t.dtype == ts[0].dtype for t in ts):
        span = contiguous_span(sorted(ts, key=lambda t: t.data_ptr()))
        if span is not None:
            return [span.view(ts[0].dtype)]
    return ts


def _fits_expert(W: object, A: Tensor, B: Tensor, r: int) -> bool:
    """PEFT's expert layout: ``A [E*r, in]``, ``B [out, r*E]`` for ``W [E, out, in]``."""
    if not isinstance(W, torch.Tensor) or W.dim() != 3:
        return False
    E, out, inn = W.shape
    return tuple(A.shape) == (E * r, inn) and tuple(B.shape) == (out, r * E)


class EngineLora:
    """The engine's adapters and the hooks that apply them. The registry (:meth:`load`,
    :meth:`unload`, :meth:`acquire`, :meth:`release`) is guarded by a lock and may be called
    from any thread; a :meth:`load` that must add hooks (a module no adapter had before) runs
    on the scheduler thread, between forward passes (:meth:`hooked` tells which)."""

    def __init__(self, model: torch.nn.Module, max_loras: int = 64):
        self.model = model
        self.max_loras = max_loras
        self.adapters: dict[str, EngineAdapter] = {}
        self.rows: list[str | None] = []  # the current forward's adapter per batch row
        self._hooked: set[str] = set()
        self.modules = dict(model.named_modules())
        self._lock = threading.Lock()

    def hooked(self, ad: EngineAdapter) -> bool:
        """Every module ``ad`` adapts has its hook already (a :meth:`load` adds none)."""
        return all(p in self._hooked for p in (*ad.linear, *ad.experts))

    # -------------------------------------------------------------- registry
    def load(self, ad: EngineAdapter) -> None:
        """Add ``ad`` under its name. Raises LoraError if the name is taken or too many are loaded."""
        with self._lock:
            if ad.name in self.adapters:
                raise LoraError(f"The LoRA adapter {ad.name!r} is already loaded")
            if len(self.adapters) >= self.max_loras:
                raise LoraError(f"{len(self.adapters)} LoRA adapters loaded (max_loras_per_batch {self.max_loras}); unload one")
            for path in ad.linear:
                self._hook_linear(path)
            for path in ad.experts:
                self._hook_experts(path)
            self.adapters[ad.name] = ad

    def unload(self, name: str) -> bool:
        """Remove ``name`` now if no request holds it (True), else when the last one finishes
        (False; an adapter in a sender's memory is first copied out of it: a forward already
        running may still read the old tensors, so the caller lets it end before the sender
        is told). Raises LoraError if it is not loaded."""
        with self._lock:
            ad = self.adapters.get(name)
            if ad is None or ad.unloading:
                raise LoraError(f"The LoRA adapter {name!r} is not loaded")
            if ad.holders:
                if ad.sender is not None:
                    ad.linear = {p: (A.clone(), B.clone()) for p, (A, B) in ad.linear.items()}
                    ad.experts = {p: {q: (A.clone(), B.clone()) for q, (A, B) in d.items()} for p, d in ad.experts.items()}
                    ad.sender = None
                ad.unloading = True
                return False
            del self.adapters[name]
            return True

    def acquire(self, name: str) -> None:
        """A request starts on ``name``. Raises LoraError if it is not loaded (or being unloaded)."""
        with self._lock:
            ad = self.adapters.get(name)
            if ad is None or ad.unloading:
                raise LoraError(f"The LoRA adapter {name!r} is not loaded (loaded: {self.names()})")
            ad.holders += 1

    def release(self, name: str) -> None:
        """A request on ``name`` finished; an adapter marked for unloading leaves with its last request."""
        with self._lock:
            ad = self.adapters.get(name)
            if ad is None:
                return
            ad.holders -= 1
            if ad.unloading and ad.holders <= 0:
                del self.adapters[name]

    @staticmethod
    def version_of(name: str) -> str:
        """The ``weight_version`` tokens generated on adapter ``name`` record: ``V`` for a name
        ``BASE@V`` (the adapter sync's names), else the name itself."""
        return name.rsplit("@", 1)[1] if "@" in name else name

    def names(self) -> list[str]:
        return [n for n, a in list(self.adapters.items()) if not a.unloading]

    # -------------------------------------------------------------- forward
    def _active(self) -> list[tuple[EngineAdapter, Tensor]]:
        """(adapter, row indices) of each adapter in the current rows."""
        by: dict[str, list[int]] = {}
        for i, n in enumerate(self.rows):
            if n is not None:
                by.setdefault(n, []).append(i)
        return [(self.adapters[n], torch.tensor(ix, dtype=torch.long)) for n, ix in by.items()]

    def _hook_linear(self, path: str) -> None:
        if path in self._hooked:
            return
        mod = self.modules[path]

        def hook(_m: torch.nn.Module, args: tuple, y: Tensor) -> Tensor:
            active = self._active()
            if not active:
                return y
            x = args[0]
            y = y.clone()
            for ad, rows in active:
                ab = ad.linear.get(path)
                if ab is None:
                    continue
                A, B = ab
                rows = rows.to(x.device)
                xr = x.index_select(0, rows)
                y.index_add_(0, rows, ((xr.to(A.dtype) @ A.t()) @ B.t() * ad.scaling).to(y.dtype))
            return y

        mod.register_forward_hook(hook)
        self._hooked.add(path)

    def _hook_experts(self, path: str) -> None:
        if path in self._hooked:
            return
        mod = self.modules[path]
        base_forward = mod.forward

        def forward(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
            active = [(ad, rows) for ad, rows in self._active() if path in ad.experts]
            if not active:
                return base_forward(hidden, top_k_index, top_k_weights)
            return self._experts_forward(mod, path, active, hidden, top_k_index, top_k_weights)

        mod.forward = forward
        self._hooked.add(path)

    def _experts_forward(self, mod: Any, path: str, active: list, hidden_TH: Tensor, idx_TK: Tensor,
                         w_TK: Tensor) -> Tensor:
        """transformers' eager expert loop (``MixtralExperts.forward``) with each token's adapter
        added to ``gate_up`` and ``down``; tokens are ``[rows * S]`` in row order."""
        T = hidden_TH.shape[0]
        n_rows = len(self.rows)
        tok_ad = torch.full((T,), -1, dtype=torch.long, device=hidden_TH.device)
        S = T // max(n_rows, 1)
        for k, (_, rows) in enumerate(active):
            for r in rows.tolist():
                tok_ad[r * S:(r + 1) * S] = k
        out = torch.zeros_like(hidden_TH)
        E = mod.gate_up_proj.shape[0]
        for e in range(E):
            pos, tok = torch.where(idx_TK.t() == e)  # [K, T] -> (k, token)
            if tok.numel() == 0:
                continue
            x = hidden_TH[tok]
            ads = tok_ad[tok]

            def adapted(y: Tensor, inp: Tensor, pname: str) -> Tensor:
                """``y`` plus each row's adapter delta on expert ``e``'s ``pname``."""
                for k, (ad, _) in enumerate(active):
                    ab = ad.experts[path].get(pname)
                    sel = (ads == k).nonzero().flatten()
                    if ab is not None and sel.numel():
                        A, B = ab
                        y.index_add_(0, sel, ((inp[sel].to(A.dtype) @ A[e].t()) @ B[e].t() * ad.scaling).to(y.dtype))
                return y

            gu = adapted(F.linear(x, mod.gate_up_proj[e]), x, "gate_up_proj")
            gate, up = gu.chunk(2, dim=-1)
            h = mod.act_fn(gate) * up
            d = adapted(F.linear(h, mod.down_proj[e]), h, "down_proj")
            d = d * w_TK[tok, pos, None]
            out.index_add_(0, tok, d.to(out.dtype))
        return out

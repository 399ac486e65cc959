"""Megatron adapters -> Hugging Face PEFT tensors, planned once per adapter layout.

:func:`plan_peft` reads the family's mapping table once for a layout (the Megatron names, shapes
and dtypes of :func:`~moe_async.lora.peft_export.megatron_adapter_state`) and lists one step per
PEFT tensor: its name, shape, dtype and the copy that fills it (a factor whole; the rows of a
fused ``B`` that one HF weight takes, found by running the rule's ``split`` once on row numbers;
the experts' ``A`` end to end; the experts' ``B`` interleaved). :meth:`PeftPlan.run` then does
only those copies, each straight into its destination (e.g. a slot of the sender's
shared-memory bucket). :class:`PeftExporter` keeps the names and the plan of one model.
Layouts as in :mod:`moe_async.lora.peft_export`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from moe_async.lora.layers import AdaptedLinear
from moe_async.lora.peft_export import EXPERT_PARAMS, PEFT_PREFIX, Destination, adapter_names, megatron_adapter_state
from moe_async.models.family import ModelFamily
from moe_async.types import JsonDict

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

Tensor = torch.Tensor
#: ``(name, A shape, B shape, A dtype, B dtype)`` of each adapter, in the state's order
Signature = tuple[tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype, torch.dtype], ...]


def signature(state: dict[str, tuple[Tensor, Tensor]]) -> Signature:
    """The layout of a Megatron adapter state (what a :class:`PeftPlan` is built for)."""
    return tuple((k, tuple(A.shape), tuple(B.shape), A.dtype, B.dtype) for k, (A, B) in state.items())


@dataclass(frozen=True)
class Step:
    """One PEFT tensor ``name`` [``shape``] ``dtype`` from the Megatron adapters ``keys``.

    ``kind``: ``"A"`` / ``"B"`` a factor of ``keys[0]`` whole; ``"rows"`` the rows ``index`` of
    its ``B`` (``start`` >= 0: the ``shape[0]`` rows from ``start``); ``"split"`` part ``part``
    of ``split(B)`` (a rule whose split is not a choice of rows); ``"experts_A"`` the experts'
    ``A`` stacked on dim 0; ``"experts_B"`` the experts' ``B`` with expert ``e``'s column ``j``
    at ``j*E + e``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    keys: tuple[str, ...]
    index: Tensor | None = None
    start: int = -1
    split: Callable[[Tensor], list[Tensor]] | None = None
    part: int = 0


def _row_steps(names: Sequence[str], key: str, B: Tensor, split: Callable[[Tensor], list[Tensor]]) -> list[Step]:
    """Steps giving each of ``names`` its part of ``split(B)``: the rows each part is made of,
    found by splitting a tensor of row numbers (float64, exact); ``"split"`` steps when a part
    is not a choice of whole rows."""
    rows, r = B.shape
    probe = torch.arange(rows * r, dtype=torch.float64).reshape(rows, r)
    parts = split(probe)
    steps = []
    for i, (n, p) in enumerate(zip(names, parts, strict=True)):
        shape = tuple(p.shape)
        idx = (p[:, 0] // r).long() if p.dim() == 2 and p.shape[1] == r and len(p) else None
        if idx is None or not (0 <= int(idx.min()) and int(idx.max()) < rows) \
                or not torch.equal(p, probe.index_select(0, idx)):
            steps.append(Step(n, shape, B.dtype, "split", (key,), split=split, part=i))
        elif torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + len(idx))):
            steps.append(Step(n, shape, B.dtype, "rows", (key,), start=int(idx[0])))
        else:
            steps.append(Step(n, shape, B.dtype, "rows", (key,), index=idx))
    return steps


def _bound(split: Callable[[Tensor, Any], list[Tensor]], a: Any) -> Callable[[Tensor], list[Tensor]]:
    """``split`` of a mapping rule with the family's arch args ``a`` bound."""
    return lambda t: split(t, a)


@dataclass(frozen=True)
class PeftPlan:
    """The PEFT tensors of one adapter layout (:func:`plan_peft`): ``steps`` in output order,
    ``target_modules`` and ``target_parameters`` of its ``adapter_config.json``."""

    signature: Signature
    steps: tuple[Step, ...]
    target_modules: list[str]
    target_parameters: list[str]

    def run(self, state: dict[str, tuple[Tensor, Tensor]], out: Destination | None = None) -> dict[str, Tensor]:
        """The PEFT tensors of ``state`` (its layout must be :attr:`signature`), each a copy,
        written where ``out(name, shape, dtype)`` says when it returns a tensor, else new."""
        res: dict[str, Tensor] = {}
        for s in self.steps:
            t = out(s.name, s.shape, s.dtype) if out is not None else None
            if t is None:
                t = torch.empty(s.shape, dtype=s.dtype)
            res[s.name] = t
            k = s.kind
            if k == "A":
                t.copy_(state[s.keys[0]][0])
            elif k == "B":
                t.copy_(state[s.keys[0]][1])
            elif k == "rows":
                B = state[s.keys[0]][1]
                if s.index is None:
                    t.copy_(B.narrow(0, s.start, s.shape[0]))
                else:
                    torch.index_select(B, 0, s.index, out=t)
            elif k == "experts_A":
                torch.cat([state[e][0] for e in s.keys], dim=0, out=t)
            elif k == "experts_B":
                n = len(s.keys)
                v = t.view(s.shape[0], s.shape[1] // n, n)  # column j*E + e
                for e, key in enumerate(s.keys):  # one strided copy per expert (twice as fast as stack(out=))
                    v[:, :, e].copy_(state[key][1])
            else:  # "split"
                assert s.split is not None
                t.copy_(s.split(state[s.keys[0]][1])[s.part])
        return res


def plan_peft(state: dict[str, tuple[Tensor, Tensor]], family: ModelFamily, hf_config: JsonDict) -> PeftPlan:
    """The :class:`PeftPlan` of ``state``'s layout under the HF names of ``family``'s mapping
    table: a fused Megatron weight (``linear_qkv``, ``linear_fc1``) gives its ``B`` to the HF
    names through the same split as the weight, and the shared ``A`` to each of them; routed
    experts become PEFT's adapters on transformers' fused expert parameters.

    Raises:
        KeyError: an adapted Megatron weight with no HF name in the table.
        ValueError: some but not all experts of a layer adapted.
    """
    a = family.arch_args(hf_config)
    table = family.table(a).by_megatron
    steps: list[Step] = []
    modules: set[str] = set()
    experts: dict[tuple[str, str], dict[int, str]] = {}
    for name in sorted(state):
        A, B = state[name]
        if name not in table:
            raise KeyError(f"LoRA adapter on {name!r}: the family's mapping table has no such Megatron weight")
        rule, hf_names = table[name]
        m = re.search(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", name)
        if m is not None:
            # transformers 5 holds every family's routed experts fused at ``model.layers.{i}.mlp.experts``
            # (whatever the on-disk names, e.g. Mixtral's block_sparse_moe.experts.N.w1): PEFT's names
            layer = re.match(r"decoder\.layers\.(\d+)\.", name)
            assert layer is not None
            experts.setdefault((f"model.layers.{layer.group(1)}.mlp.experts", m.group(2)), {})[int(m.group(1))] = name
            continue
        bases = [hf[: -len(".weight")] for hf in hf_names]
        b_steps = _row_steps([f"{PEFT_PREFIX}{b}.lora_B.weight" for b in bases], name, B,
                             _bound(rule.split, a))
        for base, bs in zip(bases, b_steps):
            steps.append(Step(f"{PEFT_PREFIX}{base}.lora_A.weight", tuple(A.shape), A.dtype, "A", (name,)))
            steps.append(Step(bs.name, bs.shape, bs.dtype, "B", (name,)) if bs.start == 0 and bs.shape == tuple(B.shape)
                         else bs)
            modules.add(base.rsplit(".", 1)[1])
    params: list[str] = []
    fcs_by_module: dict[str, list[str]] = {}
    for module, fc in experts:
        fcs_by_module.setdefault(module, []).append(fc)
    for (module, fc), per in sorted(experts.items()):
        n = a.num_experts or 0  # expert adapters exist only for a MoE family
        if sorted(per) != list(range(n)):
            raise ValueError(f"{module}: LoRA adapters on experts {sorted(per)} of {n}; PEFT adapts all of them")
        keys = tuple(per[e] for e in range(n))
        A0, B0 = state[keys[0]]
        (r, inn), (o, _) = A0.shape, B0.shape
        key = f"{module}.base_layer" if len(fcs_by_module[module]) == 2 and fc == "linear_fc1" else module
        steps.append(Step(f"{PEFT_PREFIX}{key}.lora_A.weight", (n * r, inn), A0.dtype, "experts_A", keys))  # expert-major
        steps.append(Step(f"{PEFT_PREFIX}{key}.lora_B.weight", (o, r * n), B0.dtype, "experts_B", keys))
        pname = "mlp.experts." + EXPERT_PARAMS[fc]
        if pname not in params:
            params.append(pname)
    params.sort(key=lambda p: list(EXPERT_PARAMS.values()).index(p.rsplit(".", 1)[1]))
    return PeftPlan(signature(state), tuple(steps), sorted(modules), params)


def peft_state(state: dict[str, tuple[Tensor, Tensor]], family: ModelFamily, hf_config: JsonDict,
               out: Destination | None = None) -> tuple[dict[str, Tensor], list[str], list[str]]:
    """Megatron adapters (:func:`~moe_async.lora.peft_export.megatron_adapter_state`) ->
    ``(PEFT tensors, target_modules, target_parameters)`` (:func:`plan_peft`, then
    :meth:`PeftPlan.run`): every PEFT tensor a copy (none aliases ``state``), written where
    ``out(name, shape, dtype)`` says when it returns a tensor, else a new tensor.
    Raises as :func:`plan_peft`."""
    plan = plan_peft(state, family, hf_config)
    return plan.run(state, out), plan.target_modules, plan.target_parameters


class PeftExporter:
    """The PEFT export of one model's adapters (``models``' chunks, ``linears`` per chunk),
    keeping the adapters' global names and the :class:`PeftPlan` of their layout between
    exports (a layout change, e.g. a dtype, plans again)."""

    def __init__(self, models: Sequence[GPTModel], linears: Sequence[Sequence[AdaptedLinear]],
                 family: ModelFamily, hf_config: JsonDict):
        self.models, self.linears, self.family, self.hf_config = models, linears, family, hf_config
        self._names = adapter_names(models, linears)
        self._plan: PeftPlan | None = None

    def __call__(self, out: Destination | None = None) -> tuple[dict[str, Tensor], list[str], list[str]]:
        """:func:`peft_state` of the adapters now (collective at world size > 1)."""
        state = megatron_adapter_state(self.models, self.linears, copy=False, names=self._names)
        if self._plan is None or self._plan.signature != signature(state):
            self._plan = plan_peft(state, self.family, self.hf_config)
        return self._plan.run(state, out), self._plan.target_modules, self._plan.target_parameters

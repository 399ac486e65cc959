"""The declarative Megatron <-> Hugging Face parameter mapping engine.

A family declares a list of :class:`Rule` objects; each rule names ONE Megatron parameter
(template with ``{i}`` = layer, ``{e}`` = expert) and the HF on-disk tensors it is made of,
plus the pure functions that fuse (HF -> Megatron) and split (Megatron -> HF) them. The rules
are expanded over the layer/expert indices of a concrete HF config into an exact-name table,
so every name is checked exactly (no substring or regex matching) and both directions raise
on any source key they did not use or any target key they did not set.

Tensors are full (unsharded): TP/EP/PP gathering happens before (export) or slicing after
(load) this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

Tensor = torch.Tensor


def _identity_in(ts: Sequence[Tensor], cfg) -> Tensor:
    (t,) = ts
    return t


def _identity_out(t: Tensor, cfg) -> list[Tensor]:
    return [t]


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter <-> its HF source tensors.

    Attributes:
        megatron: Megatron name template (``{i}`` layer index, ``{e}`` expert index).
        hf: HF on-disk name templates, in the order ``fuse`` takes and ``split`` returns them.
        fuse: ``(hf_tensors, cfg) -> megatron_tensor``.
        split: ``(megatron_tensor, cfg) -> hf_tensors`` (inverse of ``fuse``, bit-exact).
        scope: ``"global"``, ``"layer"`` (expanded over ``{i}``) or ``"expert"`` (``{i}``,``{e}``).
    """

    megatron: str
    hf: tuple[str, ...]
    fuse: Callable[[Sequence[Tensor], Any], Tensor] = _identity_in  # (tensors, the family's ArchArgs)
    split: Callable[[Tensor, Any], list[Tensor]] = _identity_out
    scope: str = "global"


def cat_rows(ts: Sequence[Tensor], cfg) -> Tensor:
    """``[gate; up]`` stacking along dim 0 (Megatron's gated ``linear_fc1`` layout)."""
    return torch.cat(list(ts), dim=0)


def split_rows_2(t: Tensor, cfg) -> list[Tensor]:
    """Inverse of :func:`cat_rows` for two equal halves."""
    a, b = torch.chunk(t, 2, dim=0)
    return [a.contiguous(), b.contiguous()]


@dataclass(frozen=True)
class ExpandedTable:
    """Concrete, exact-name table for one model config."""

    by_megatron: dict[str, tuple[Rule, tuple[str, ...]]]
    hf_keys: tuple[str, ...]


def expand(
    rules: Iterable[Rule],
    num_layers: int,
    num_experts: int,
    cfg,
    skip: Callable[[Rule, Any], bool] | None = None,
    scopes: Mapping[str, Sequence[Mapping[str, int]]] | None = None,
) -> ExpandedTable:
    """Expand rule templates over layers/experts into an exact-name table.

    A rule's ``scope`` picks the index dicts its templates are formatted with: ``"global"``
    (``{}``), ``"layer"`` (``{"i": i}`` for every layer), ``"expert"`` (``{"i": i, "e": e}`` for
    every layer and expert); ``scopes`` adds or replaces scopes (e.g. DeepSeek-V3's dense and
    MoE layers). ``skip(rule, cfg)`` true drops a rule.

    Raises:
        ValueError: a rule's scope is unknown, or two rules give the same Megatron or HF name.
    """
    idx_of: dict[str, Sequence[Mapping[str, int]]] = {
        "global": [{}],
        "layer": [{"i": i} for i in range(num_layers)],
        "expert": [{"i": i, "e": e} for i in range(num_layers) for e in range(num_experts)],
        **(scopes or {}),
    }
    by_m: dict[str, tuple[Rule, tuple[str, ...]]] = {}
    hf_keys: list[str] = []
    for r in rules:
        if skip is not None and skip(r, cfg):
            continue
        if r.scope not in idx_of:  # pragma: no cover - declaration error
            raise ValueError(f"unknown rule scope {r.scope!r}")
        for kw in idx_of[r.scope]:
            m = r.megatron.format(**kw)
            hs = tuple(h.format(**kw) for h in r.hf)
            if m in by_m:
                raise ValueError(f"mapping declares Megatron name {m!r} twice")
            by_m[m] = (r, hs)
            hf_keys.extend(hs)
    if len(set(hf_keys)) != len(hf_keys):
        raise ValueError("mapping declares an HF name twice")
    return ExpandedTable(by_m, tuple(hf_keys))


def gated_mlp_rules(megatron: str, hf: str, names: tuple[str, str, str], scope: str) -> list[Rule]:
    """The two rules of a gated (SwiGLU) MLP: Megatron ``{megatron}linear_fc1.weight`` [2I,H] =
    ``[{hf}{gate}.weight; {hf}{up}.weight]`` (:func:`cat_rows`) and ``{megatron}linear_fc2.weight``
    [H,I] = ``{hf}{down}.weight``, where ``names = (gate, up, down)``; both of ``scope``."""
    gate, up, down = names
    return [
        Rule(megatron + "linear_fc1.weight", (hf + gate + ".weight", hf + up + ".weight"),
             fuse=cat_rows, split=split_rows_2, scope=scope),
        Rule(megatron + "linear_fc2.weight", (hf + down + ".weight",), scope=scope),
    ]


def hf_keys_error(missing: Sequence[str], unused: Sequence[str]) -> KeyError:
    """The KeyError of an HF -> Megatron conversion whose HF tensors do not match the table:
    names the first 20 ``missing`` (wanted, absent) and ``unused`` (present, wanted by no
    rule) HF tensor names, sorted, with their counts."""
    missing, unused = sorted(missing), sorted(unused)
    parts = ([f"missing HF tensors {missing[:20]} (of {len(missing)})"] if missing else []) + (
        [f"unused HF tensors {unused[:20]} (of {len(unused)})"] if unused else [])
    return KeyError("HF -> Megatron conversion: " + "; ".join(parts))


def fuse_all(table: ExpandedTable, hf_state: Mapping[str, Tensor], cfg) -> dict[str, Tensor]:
    """HF -> Megatron over a full state; raises naming unused HF keys / missing HF sources."""
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    for m, (rule, hs) in table.by_megatron.items():
        absent = [h for h in hs if h not in hf_state]
        if absent:
            missing.extend(absent)
            continue
        out[m] = rule.fuse([hf_state[h] for h in hs], cfg)
        used.update(hs)
    unused = sorted(set(hf_state) - used)
    if missing or unused:
        raise hf_keys_error(missing, unused)
    return out


def split_all(
    table: ExpandedTable, named: Iterable[tuple[str, Tensor]], cfg
) -> Iterator[tuple[str, Tensor]]:
    """Megatron -> HF, streaming; raises on an unknown Megatron name (at once), a name given
    twice (at once), or any HF key left unset (after the input is exhausted)."""
    seen: set[str] = set()
    for m, t in named:
        if m not in table.by_megatron:
            raise KeyError(f"Megatron -> HF conversion: unknown/unused Megatron tensor {m!r}")
        if m in seen:
            raise KeyError(f"Megatron -> HF conversion: Megatron tensor {m!r} given twice")
        seen.add(m)
        rule, hs = table.by_megatron[m]
        parts = rule.split(t, cfg)
        if len(parts) != len(hs):  # pragma: no cover - declaration error
            raise ValueError(f"rule for {m!r} split into {len(parts)} tensors, expected {len(hs)}")
        yield from zip(hs, parts)
    unset = sorted(set(table.by_megatron) - seen)
    if unset:
        hf_unset = [h for m in unset for h in table.by_megatron[m][1]]
        raise KeyError(
            f"Megatron -> HF conversion: HF tensors not set {hf_unset[:20]} (of {len(hf_unset)}),"
            f" Megatron tensors missing {unset[:20]}"
        )

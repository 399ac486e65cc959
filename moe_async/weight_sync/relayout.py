"""Zero-copy export for a trainer whose rank holds every tensor whole (1 process).

At TP = PP = EP = 1 with the engine's dtype, each parameter whose HF tensors are pure views
of it is moved into the transport's send buffer once, so a sync sends the parameters'
own memory with no per-sync copy; values and gradients are unchanged.

Design notes: ``docs/design/weight_sync.md``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch

from moe_async.weight_sync.packing import contiguous_span

Tensor = torch.Tensor
#: ``out(hf_name, shape, dtype) -> Tensor | None``: BroadcastTransport.destination
Destination = Callable[[str, tuple[int, ...], torch.dtype], Tensor | None]


Strided = tuple[tuple[int, ...], tuple[int, ...], int]  # as_strided (sizes, strides, element offset)


@dataclass
class _Entry:
    name: str  # 1-process Megatron (local-spec) name
    tensor: Tensor  # the Parameter (or buffer) holding it whole
    rows: int | None  # vocab params: HF rows (the parameter may hold padded rows after them)
    hf: list[tuple[str, tuple[int, ...], torch.dtype]]  # its HF tensors, in split order
    views: bool  # the HF tensors are views that tile the parameter in order (movable)
    strided: list[Strided] | None  # else: each HF tensor as one strided read of the parameter

    def full(self) -> Tensor:
        t = self.tensor.data
        return t if self.rows is None or self.rows == t.shape[0] else t[: self.rows]


def strided_layout(index: Tensor) -> Strided | None:
    """``(sizes, strides, offset)`` such that ``x.reshape(-1).as_strided(sizes, strides, offset)``
    reads the elements ``index`` (flat int64 positions into ``x``, in order), or None when no
    single strided view does (non-affine, or a negative step). Dims are found innermost first:
    the longest run of one step, tiled exactly by the rest (e.g. the q rows of Megatron's
    fused QKV, ``[ng, q_rows_per_group * H]`` with strides ``[group_rows * H, 1]``)."""
    cur = index.reshape(-1)
    if cur.numel() == 0:
        return None
    sizes: list[int] = []
    strides: list[int] = []
    while cur.numel() > 1:
        d = cur[1:] - cur[:-1]
        step = int(d[0])
        if step < 0:
            return None
        bad = (d != step).nonzero()
        run = int(bad[0, 0]) + 1 if bad.numel() else cur.numel()
        if cur.numel() % run:
            return None
        rows = cur.view(-1, run)
        if not bool((rows == rows[:, :1] + step * torch.arange(run, dtype=cur.dtype)).all()):
            return None
        sizes.insert(0, run)
        strides.insert(0, step)
        cur = rows[:, 0].contiguous()
    return tuple(sizes) or (1,), tuple(strides) or (1,), int(cur[0])


def _read(t: Tensor, lay: Strided) -> Tensor:
    """The strided view ``lay`` of contiguous ``t`` (offset relative to ``t``'s first element)."""
    sizes, strides, off = lay
    return t.as_strided(sizes, strides, t.storage_offset() + off)


class WholeTensorExport:
    """Export plan of a 1-process trainer (design notes: ``docs/design/weight_sync.md``).

    Args:
        whole: ``{1-process name: (tensor holding it whole, vocab rows or None)}``
            (:func:`moe_async.megatron.hf_export.whole_tensors`).
        split: ``split(megatron_name, full_tensor) -> [(hf_name, tensor), ...]`` (the
            family's mapping rule for that name, e.g. ``rule.split``); called once per name
            here to learn the HF names/shapes and whether they are views of the parameter.
    """

    def __init__(self, whole: dict[str, tuple[Tensor, int | None]],
                 split: Callable[[str, Tensor], list[tuple[str, Tensor]]]):
        self.entries: dict[str, _Entry] = {}
        self.split = split
        for name in sorted(whole):
            p, rows = whole[name]
            e = _Entry(name, p, rows, [], False, None)
            t = e.full()
            parts = split(name, t)
            e.hf = [(h, tuple(x.shape), x.dtype) for h, x in parts]
            span = contiguous_span([x for _, x in parts]) if parts else None
            nb = p.numel() * p.element_size()
            e.views = (span is not None and p.data.is_contiguous() and span.data_ptr() == p.data_ptr()
                       and span.numel() == nb and all(x.dtype == p.dtype for _, x in parts))
            if not e.views and t.is_contiguous() and all(x.dtype == t.dtype for _, x in parts):
                e.strided = self._probe(name, t, parts, split)
            self.entries[name] = e

    @staticmethod
    def _probe(name: str, t: Tensor, parts: list[tuple[str, Tensor]],
               split: Callable[[str, Tensor], list[tuple[str, Tensor]]]) -> list[Strided] | None:
        """Each HF tensor of ``t`` as one strided read of it (so the export copies it once,
        straight into its destination, instead of split + copy), or None. Found by splitting
        the element positions of ``t`` with the same rule, and proven on the values: every
        read equals the rule's own output bit for bit (a rule that computes is never read)."""
        try:
            idx = split(name, torch.arange(t.numel(), dtype=torch.int64).view(t.shape))
        except Exception:  # noqa: BLE001 - a rule that is not a pure selection: split + copy
            return None
        out = []
        for (_, pos), (_, x) in zip(idx, parts):
            ok = (pos.dtype == torch.int64 and pos.shape == x.shape and pos.numel() > 0
                  and 0 <= int(pos.min()) and int(pos.max()) < t.numel())
            lay = strided_layout(pos) if ok else None
            if lay is None or not torch.equal(_read(t, lay).reshape(x.shape), x):
                return None
            out.append(lay)
        return out if len(idx) == len(parts) else None

    def export(self, order: Sequence[str], out: Destination | None,
               dtype: torch.dtype | None) -> Iterator[tuple[str, Tensor]]:
        """``(hf_name, tensor)`` of every tensor, Megatron names in ``order``: a relaid
        parameter's own views where ``out`` places them (no copy); else copied (cast to
        ``dtype``) into ``out``'s tensor, or into a fresh CPU tensor without one. Tensors
        with a strided read are copied once, straight from the parameter."""
        for n in order:
            e = self.entries[n]
            dsts = self._relaid(e, out) if dtype is None or dtype == e.tensor.dtype else None
            if dsts is not None:  # a relaid parameter: its HF tensors are out's own views
                for (h, _, _), d in zip(e.hf, dsts):
                    yield h, d
                continue
            t = e.full()
            if e.strided is None:
                parts = self.split(n, t)
            else:
                parts = [(h, _read(t, lay)) for (h, _, _), lay in zip(e.hf, e.strided)]
            for (h, x), (_, shape, dt) in zip(parts, e.hf):
                want = dtype or dt
                dst = out(h, shape, want) if out is not None else None
                if dst is not None and same_memory(dst, x):  # a relaid parameter's own view
                    yield h, dst
                    continue
                if dst is None:
                    dst = torch.empty(shape, dtype=want)
                dst.view(x.shape).copy_(x)  # strided reads: x has the read's sizes
                yield h, dst

    @staticmethod
    def _relaid(e: _Entry, out: Destination | None) -> list[Tensor] | None:
        """``out``'s tensors for ``e``'s HF names when they ARE the parameter's memory (it was
        moved there by :meth:`bind`): each contiguous, of the parameter's dtype and device,
        end to end in order from its first byte to its last. Since ``e.views`` means the HF
        tensors tile the parameter in that order, each one is then exactly the rule's split
        (no split or view of the parameter needed to know it). None otherwise."""
        p = e.tensor.data
        if out is None or not e.views or not p.is_contiguous():
            return None
        ptr = p.data_ptr()
        dsts = []
        for h, shape, dt in e.hf:
            d = out(h, shape, dt)
            if (d is None or d.data_ptr() != ptr or d.dtype != p.dtype or d.device != p.device
                    or not d.is_contiguous()):
                return None
            dsts.append(d)
            ptr += d.numel() * d.element_size()
        return dsts if ptr == p.data_ptr() + p.numel() * p.element_size() else None

    def named(self, order: Sequence[str] | None = None) -> Iterator[tuple[str, Tensor]]:
        """``(megatron_name, full tensor)``: views of the parameters (vocab padding dropped),
        in ``order`` (default: sorted names)."""
        for n in (order if order is not None else self.entries):
            yield n, self.entries[n].full()

    def order(self, out: Destination) -> list[str]:
        """Names sorted by where ``out`` puts their first HF tensor (the engines' layout order,
        so the transport can form bucket k while the rest is exported); names ``out`` has no
        place for last, by name."""
        def key(n: str):
            h, shape, dt = self.entries[n].hf[0]
            d = out(h, shape, dt)
            return (0, d.untyped_storage().data_ptr(), d.data_ptr()) if d is not None else (1, 0, 0)

        return sorted(self.entries, key=lambda n: (key(n), n))

    @torch.no_grad()
    def bind(self, out: Destination) -> dict[str, int]:
        """Move every movable parameter into the span ``out`` gives its HF tensors (its bytes
        copied there first; ``param.data`` re-pointed): skipped where it already lies, where
        ``out`` has no place for one of them, where their places are not end to end in one
        storage, or on another device. Idempotent; cheap when nothing moves.

        Returns ``relaid_tensors``/``relaid_bytes`` (parameters now in ``out``'s buffer),
        ``moved_tensors`` (moved by this call), ``copied_tensors``/``copied_bytes`` (the rest:
        copied into ``out`` by each export).
        """
        st = dict(relaid_tensors=0, relaid_bytes=0, moved_tensors=0, copied_tensors=0, copied_bytes=0)
        for e in self.entries.values():
            p = e.tensor
            nb = p.numel() * p.element_size()
            span = None
            if e.views:
                if self._relaid(e, out) is not None:
                    st["relaid_tensors"] += 1  # already there (every later export)
                    st["relaid_bytes"] += nb
                    continue
                dsts = [out(h, shape, dt) for h, shape, dt in e.hf]
                present = [d for d in dsts if d is not None]
                if len(present) == len(dsts):
                    span = contiguous_span(present)
            if span is None or span.numel() != nb or span.device != p.device:
                st["copied_tensors"] += 1
                st["copied_bytes"] += nb
                continue
            if span.data_ptr() != p.data_ptr():
                span.copy_(p.data.reshape(-1).view(torch.uint8))
                p.data = span.view(p.dtype).view(p.shape)
                st["moved_tensors"] += 1
            st["relaid_tensors"] += 1
            st["relaid_bytes"] += nb
        return st


def same_memory(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` are the same bytes seen the same way (no copy needed from one to the other)."""
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.is_contiguous() and b.is_contiguous() and a.device == b.device)


def describe(st: Mapping[str, float]) -> str:
    """One line for logs: how much of the model the export sends without a copy."""
    tot = st["relaid_bytes"] + st["copied_bytes"]
    return (f"{st['relaid_tensors']} tensors ({st['relaid_bytes'] / 1e6:.1f} MB, "
            f"{100 * st['relaid_bytes'] / max(tot, 1):.0f}%) live in the send buffer, "
            f"{st['copied_tensors']} ({st['copied_bytes'] / 1e6:.1f} MB) copied per sync")

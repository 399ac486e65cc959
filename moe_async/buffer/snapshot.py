"""The buffer's part of a whole-run checkpoint: its buffered groups and counters.

:func:`snapshot` turns the buffered groups (every :class:`~moe_async.types.Sample` field kept)
and the buffer's counters into a JSON-able dict saved in ``moe_async_state.json``;
:func:`restore` puts them back into a resumed buffer, dropping groups more than K versions
behind the loaded version as ``stale``. A malformed snapshot raises naming the field.

Design notes: ``docs/design/buffer.md``."""

from __future__ import annotations

import base64
from dataclasses import fields
from typing import TypedDict

import numpy as np

from moe_async.buffer.buffer import BufferStats, RolloutBuffer
from moe_async.types import Group, JsonDict, Sample

FORMAT = 1


_ARRAYS = ("routed_experts", "teacher_topk_ids", "teacher_topk_logprobs")  # numpy fields: dtype, shape, base64


class EncodedArray(TypedDict):
    """A numpy array as JSON: its dtype name, shape and base64 bytes (C order)."""

    dtype: str
    shape: list[int]
    b64: str


class BufferSnapshot(TypedDict):
    """:func:`snapshot`: the format number, the groups (``group_id``, ``start_version``,
    ``samples`` as :func:`sample_to_dict`) and the buffer's counters."""

    format: int
    groups: list[JsonDict]
    counters: BufferStats


def _encode(a: np.ndarray | None) -> EncodedArray | None:
    if a is None:
        return None
    b64 = base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()
    return {"dtype": str(a.dtype), "shape": list(a.shape), "b64": b64}


def _decode(r: EncodedArray | None) -> np.ndarray | None:
    if r is None:
        return None
    return np.frombuffer(base64.b64decode(r["b64"]), dtype=np.dtype(r["dtype"])).reshape(r["shape"]).copy()


def sample_to_dict(s: Sample) -> JsonDict:
    """Every field of ``s`` as JSON-able values (numpy fields ``routed_experts`` and
    ``teacher_topk_*``: dtype, shape, base64 bytes)."""
    d = {f.name: getattr(s, f.name) for f in fields(Sample) if f.name not in _ARRAYS}
    d["response_ids"], d["prompt_ids"] = [int(t) for t in s.response_ids], [int(t) for t in s.prompt_ids]
    d["rollout_logprobs"] = [float(x) for x in s.rollout_logprobs]
    d["weight_versions"] = [int(v) for v in s.weight_versions]
    d["metadata"] = dict(s.metadata)
    d.update({k: _encode(getattr(s, k)) for k in _ARRAYS})
    return d


def sample_from_dict(d: JsonDict) -> Sample:
    """The inverse of :func:`sample_to_dict`.

    Raises: ValueError naming the missing or unknown field, or the per-token lists that disagree."""
    names = {f.name for f in fields(Sample)}
    # snapshots written before multi-turn samples, distillation or its top-k
    d = {"loss_mask": None, "teacher_logprobs": None, "teacher_topk_ids": None, "teacher_topk_logprobs": None, **d}
    if set(d) != names:
        raise ValueError(f"buffer snapshot: sample fields differ: missing {sorted(names - set(d))}, "
                         f"unknown {sorted(set(d) - names)}")
    kw = dict(d)
    kw.update({k: _decode(kw[k]) for k in _ARRAYS})
    s = Sample(**kw)
    s.validate()
    return s


def snapshot(buf: RolloutBuffer) -> BufferSnapshot:
    """The buffered groups of ``buf`` (a :class:`~moe_async.buffer.buffer.RolloutBuffer`), oldest
    first, and its counters (``docs/design/buffer.md``)."""
    groups = [{"group_id": int(g.group_id), "start_version": int(g.start_version),
               "samples": [sample_to_dict(s) for s in g.samples]} for g in buf.buffered_groups()]
    return {"format": FORMAT, "groups": groups, "counters": buf.stats()}


def groups_from_snapshot(snap: JsonDict) -> list[Group]:
    """The groups of a :func:`snapshot` dict, in their saved order.

    Raises: ValueError naming the field when ``snap`` is not such a dict (or another format)."""
    if not isinstance(snap, dict) or snap.get("format") != FORMAT or not isinstance(snap.get("groups"), list):
        raise ValueError(f"buffer snapshot: expected a dict with format={FORMAT} and a groups list, got "
                         f"{type(snap).__name__} with keys {sorted(snap) if isinstance(snap, dict) else []}")
    return [Group(int(g["group_id"]), [sample_from_dict(s) for s in g["samples"]], int(g["start_version"]))
            for g in snap["groups"]]


def snapshot_draws(snap: JsonDict | None) -> list[int]:
    """The draw numbers (``metadata["draw_seq"]``) of a snapshot's groups (none: [])."""
    if not snap:
        return []
    out = []
    for g in snap.get("groups", []):
        seq = g["samples"][0]["metadata"].get("draw_seq") if g["samples"] else None
        if seq is not None:
            out.append(int(seq))
    return out


def restore(buf: RolloutBuffer, snap: JsonDict, trainer_version: int) -> dict[str, int]:
    """Put the groups of ``snap`` back into ``buf`` and drop those stale at ``trainer_version``
    (reason ``stale``; their draws go to ``buf.stale_draws`` as any stale drop's).

    Returns ``{"restored": n, "dropped_stale": m}`` (groups; ``n - m`` stay buffered)."""
    groups = groups_from_snapshot(snap)
    before = buf.drop_reasons.get("stale", 0)
    buf.restore_groups(groups, trainer_version)
    return {"restored": len(groups), "dropped_stale": buf.drop_reasons.get("stale", 0) - before}

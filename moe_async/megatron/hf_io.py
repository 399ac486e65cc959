"""HF checkpoint input: safetensors index and files, config and JSON side files, the streaming load.

- :func:`read_hf_index` (HF key -> file; ``model.safetensors.index.json`` or ``*.safetensors``,
  each file checked by :func:`moe_async.errors.check_safetensors_file`), :func:`iter_hf_tensors`,
  :func:`read_json_file` / :func:`read_json_dict` / :func:`read_hf_config` (errors name the file),
  :func:`hf_checkpoint_dtype` (the params dtype the files hold).
- :func:`check_hf_keys`: every HF key the family's mapping table uses and no other, else
  ``KeyError`` naming the keys, before anything is written.
- :func:`load_hf_into_model`: the converters' streaming load, one file at a time, a rank reading
  only the tensors its shards come from; :func:`load_hf_weights`: the trainer's load into its
  model chunks (all ranks, names checked across the world).
- :func:`prefault_read`: ``madvise(MADV_POPULATE_READ)`` over a memory-mapped tensor.
"""

from __future__ import annotations

import functools
import glob
import json
import os
from typing import Any, Iterator

import torch

from moe_async.megatron.parallel import cpu_tensors_only, global_rank
from moe_async.models import get_family
from moe_async.models.family import ModelFamily
from moe_async.types import JsonDict

Tensor = torch.Tensor

INDEX_NAME = "model.safetensors.index.json"
# madvise(2) advice (Linux >= 5.14, include/uapi/asm-generic/mman-common.h): map the pages of a
# range readable, as reading each page would, in one call and without breaking copy-on-write
MADV_POPULATE_READ = 22


@functools.cache
def _libc_madvise():
    """libc's ``madvise`` through ctypes, or None where it is not there (not Linux)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - a libc without madvise
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


_populate_ok = [True]  # False once the kernel refused the advice (older than 5.14): stop asking


def prefault_read(t: Tensor) -> bool:
    """Map the memory pages of CPU tensor ``t`` readable now, with ONE ``madvise(2)``
    (``MADV_POPULATE_READ``) over them, instead of on demand as they are first read. For
    tensors that are views of a memory-mapped file (``safe_open().get_tensor``, a mapped
    ``.distcp`` item) whose pages are in the page cache, read by the torch_dist save of
    HF -> Megatron and the safetensors write of Megatron -> HF (measured gain: docs/convert.md).
    The data and the mapping are unchanged (a private mapping stays copy-on-write). Returns
    True when the kernel took the advice; False (nothing done) off Linux, before Linux 5.14,
    for an empty, non-contiguous or non-CPU tensor, or a range the kernel refuses (e.g. past
    the end of the mapped file)."""
    import mmap

    f = _libc_madvise()
    n = t.numel() * t.element_size()
    if f is None or not _populate_ok[0] or n == 0 or t.device.type != "cpu" or not t.is_contiguous():
        return False
    start = t.data_ptr()
    page = start - start % mmap.PAGESIZE
    if f(page, start + n - page, MADV_POPULATE_READ) == 0:
        return True
    import ctypes
    import errno

    if ctypes.get_errno() == errno.EINVAL:  # advice unknown to this kernel
        _populate_ok[0] = False
    return False


def read_hf_index(hf_dir: str) -> dict[str, str]:
    """HF tensor name -> absolute file path, from ``model.safetensors.index.json`` when
    present (and every file it names must exist), else from the keys of every
    ``*.safetensors`` in ``hf_dir``. ValueError on a key in two files; CheckpointReadError
    (a ValueError) naming a truncated or corrupt safetensors file."""
    from safetensors import safe_open

    from moe_async.errors import check_safetensors_file

    idx = os.path.join(hf_dir, INDEX_NAME)
    if os.path.exists(idx):
        wm = read_json_dict(idx, "safetensors index").get("weight_map")
        if not isinstance(wm, dict):
            raise ValueError(f"{idx} (safetensors index) has no weight_map object")
        out = {k: os.path.join(hf_dir, v) for k, v in wm.items()}
        for p in sorted(set(out.values())):
            if not os.path.exists(p):
                raise FileNotFoundError(f"{INDEX_NAME} names {os.path.basename(p)}, which is not in {hf_dir}")
            check_safetensors_file(p)  # truncated/corrupt: named before any tensor is read
        return out
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files (and no {INDEX_NAME}) in {hf_dir}")
    out = {}
    for fp in files:
        check_safetensors_file(fp)
        with safe_open(fp, framework="pt") as h:
            for k in h.keys():
                if k in out:
                    raise ValueError(f"tensor {k!r} appears in two safetensors files ({out[k]}, {fp})")
                out[k] = fp
    return out


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "B"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=not enabled, leave=False)


# HF tensors kept in fp32 by Megatron whatever the params dtype (deepseek_v3's router bias is
# an fp32 buffer), so they may differ from the checkpoint's dtype.
FP32_ANYWAY = (".e_score_correction_bias",)


def hf_checkpoint_dtype(hf_cfg: dict, index: dict[str, str]) -> str:
    """``"fp32"`` or ``"bf16"``: the dtype the Megatron model is built in = the dtype of the
    HF embedding on disk, so that the conversion is a copy, never a cast. ValueError naming
    the first tensor of another dtype (``FP32_ANYWAY`` tensors may be F32)."""
    from safetensors import safe_open

    names = {"F32": "fp32", "BF16": "bf16"}
    dtypes: dict[str, str] = {}
    for fp in sorted(set(index.values())):
        with safe_open(fp, framework="pt") as h:
            for k in h.keys():
                if k in index:  # the keys asked about (FP8 weights and their scales may be left out)
                    dtypes[k] = h.get_slice(k).get_dtype()
    ref = dtypes.get("model.embed_tokens.weight")
    if ref not in names:
        raise ValueError(f"model.embed_tokens.weight has dtype {ref}; supported: F32, BF16")
    for k in sorted(dtypes):
        if dtypes[k] != ref and not (k.endswith(FP32_ANYWAY) and dtypes[k] == "F32"):
            raise ValueError(f"HF tensor {k} has dtype {dtypes[k]}, the checkpoint's is {ref} "
                             "(a mixed-dtype checkpoint would not round-trip exactly)")
    return names[ref]


# ------------------------------------------------------------------------- HF -> Megatron
def check_hf_keys(fam, a, index: dict[str, str], progress: bool = False) -> dict[str, str]:
    """Key-level validation of an HF checkpoint against the family table (no tensor data
    read, except the fused-expert tensors of transformers' in-memory layout, read to learn
    the per-expert names they stand for). Returns ``{on-disk HF name: file}`` where names
    that come from a fused tensor map to ``"fused:" + fused key``. KeyError naming unused
    HF keys / missing sources (every rank computes the same answer)."""
    from safetensors import safe_open

    from moe_async.models.mapping import hf_keys_error

    table = fam.table(a)
    want = set(table.hf_keys)
    src: dict[str, str] = {}
    stray: list[str] = []
    for k, fp in index.items():
        if k in want:
            if k in src:  # a fused tensor listed earlier in the index gave it already
                raise ValueError(f"HF checkpoint gives {k!r} in both the fused and the per-expert layout")
            src[k] = fp
            continue
        if a.tie_word_embeddings and k == "lm_head.weight":
            src[k] = fp  # checked equal to the embedding while reading
            continue
        # an alternative layout? normalize a placeholder of the right shape to learn the names
        with safe_open(fp, framework="pt") as h:
            shape = h.get_slice(k).get_shape()
        probe = fam.normalize_hf_state({k: torch.empty(shape, dtype=torch.int8)}, a)
        if set(probe) == {k}:
            stray.append(k)
            continue
        for n in probe:
            if n not in want:
                stray.append(f"{n} (from {k})")
            elif n in src:
                raise ValueError(f"HF checkpoint gives {n!r} in both the fused and the per-expert layout")
            else:
                src[n] = "fused:" + k
    missing = sorted(want - set(src))
    if stray or missing:
        raise hf_keys_error(missing, stray)
    return src


@torch.no_grad()
@cpu_tensors_only
def load_hf_into_model(model, hf_cfg: dict, index: dict[str, str], vocab_size: int,
                       progress: bool = True) -> dict[str, int]:
    """Copy this rank's slices of the HF checkpoint (``index``: key -> file) into ``model``,
    one file at a time. Returns stats (bytes read by this rank, files). KeyError naming
    unused / missing HF keys (before any copy), local params with no source; ValueError on
    shape mismatch (vocab padding excepted) or an untied-in-config head that differs."""
    from safetensors import safe_open

    from moe_async.megatron.sharding import _fit_vocab, local_pieces

    fam = get_family(hf_cfg.get("model_type"))
    a = fam.arch_args(hf_cfg)
    table = fam.table(a)
    from moe_async.models.deepseek_v3.hf_extras import hf_extras

    extras = hf_extras(hf_cfg, index, log_skipped=False)  # DeepSeek-V3 MTP / FP8 (hf_extras.py)
    read_scale, index = extras.scale_reader(index), extras.weights(index)
    src = check_hf_keys(fam, a, index)
    pieces = local_pieces(model)
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    by_name: dict[str, list] = {}
    for pc in pieces:
        if pc.name not in table.by_megatron:
            raise KeyError(f"weight load: model param {pc.param} (as {pc.name}) has no HF mapping")
        by_name.setdefault(pc.name, []).append(pc)
    # HF on-disk names this rank needs, and the (file, stored key) each is read from
    need: dict[str, str] = {}
    for m in by_name:
        for h in table.by_megatron[m][1]:
            need[h] = src[h]
    files: dict[str, set[str]] = {}  # file -> stored keys to read from it
    for h, s in need.items():
        if s.startswith("fused:"):
            k = s[len("fused:"):]
            files.setdefault(index[k], set()).add(k)
        else:
            files.setdefault(s, set()).add(h)
    if a.tie_word_embeddings and "lm_head.weight" in index:
        files.setdefault(index["lm_head.weight"], set()).add("lm_head.weight")
        files.setdefault(index["model.embed_tokens.weight"], set()).add("model.embed_tokens.weight")
    pending: dict[str, Tensor] = {}  # HF on-disk name -> tensor, until its Megatron tensor is fused
    done: set[str] = set()
    tied_check: dict[str, Tensor] = {}
    nbytes = 0
    total = sum(os.path.getsize(f) for f in files)
    bar = progress_bar(total, f"HF->Megatron rank {global_rank()}", progress)
    for fp in sorted(files):
        with safe_open(fp, framework="pt") as h:
            for k in sorted(files[fp]):
                t = extras.get_tensor(k, h.get_tensor(k), read_scale)
                prefault_read(t)  # a view of safetensors' map of the file: read by the copy / save below
                nbytes += t.numel() * t.element_size()
                if k in ("lm_head.weight", "model.embed_tokens.weight") and a.tie_word_embeddings:
                    tied_check[k] = t
                    if k == "lm_head.weight":
                        continue
                if k in need and not need[k].startswith("fused:"):
                    pending[k] = t
                else:
                    for n, v in fam.normalize_hf_state({k: t}, a).items():
                        if n in need:
                            pending[n] = v
        bar.update(os.path.getsize(fp))
        # fuse every Megatron tensor whose sources are all read, copy its slices, drop them
        for m, pcs in by_name.items():
            if m in done:
                continue
            rule, hs = table.by_megatron[m]
            if not all(x in pending for x in hs):
                continue
            full = rule.fuse([pending[x] for x in hs], a)
            full = _fit_vocab(m, full, pcs[0].full_shape, vocab_size)
            p = whole_param(pcs, tensors)
            if (p is not None and full.shape == p.shape and full.dtype == p.dtype and full.device == p.device
                    and full.is_contiguous()):
                # this rank holds the whole tensor (one piece, or pieces tiling the parameter:
                # SwiGLU fc1 halves): the parameter takes the tensor just read or fused (no
                # copy, and its never-touched allocation is freed unfaulted)
                p.data = full
            else:
                for pc in pcs:
                    pc.data.copy_(full[pc.index()].to(dtype=pc.data.dtype, device=pc.data.device))
            done.add(m)
            for x in hs:
                pending.pop(x, None)
    bar.close()
    if len(tied_check) == 2 and not torch.equal(tied_check["lm_head.weight"], tied_check["model.embed_tokens.weight"]):
        raise ValueError("tie_word_embeddings=True but lm_head.weight differs from model.embed_tokens.weight")
    unset = sorted(set(by_name) - done)
    if unset:  # pragma: no cover - check_hf_keys guarantees the sources
        raise KeyError(f"HF -> Megatron conversion: Megatron tensors not set {unset[:20]}")
    return {"bytes_read": nbytes, "files": len(files)}


def read_json_file(path: str, what: str = "") -> Any:
    """``json.load`` of ``path``; a file that is not valid JSON (or not UTF-8) is a
    ``ValueError`` naming the file and where it breaks (``what`` says what the file is)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}{' (' + what + ')' if what else ''} is not valid JSON: {e.msg} "
                         f"at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}{' (' + what + ')' if what else ''} is not UTF-8 text: {e.reason} "
                         f"at byte {e.start}") from None


def read_json_dict(path: str, what: str) -> dict:
    d = read_json_file(path, what)
    if not isinstance(d, dict):
        raise ValueError(f"{path} ({what}) holds a JSON {type(d).__name__}, not an object")
    return d


def read_hf_config(hf_dir: str) -> dict:
    """``hf_dir/config.json`` as a dict; FileNotFoundError / ValueError naming the file."""
    p = os.path.join(hf_dir, "config.json") if os.path.isdir(hf_dir) else hf_dir
    if not os.path.exists(p):
        raise FileNotFoundError(f"no HF config: {p} does not exist")
    return read_json_dict(p, "HF config")


def whole_param(pcs: list, params: dict[str, Tensor]) -> Tensor | None:
    """The parameter that the local pieces ``pcs`` of ONE Megatron tensor are views of, when
    it has the tensor's full shape and the pieces tile it along dim 0 in order, each at its
    own offset and spanning the other dims (Megatron's SwiGLU fc1 halves: the parameter IS the
    full tensor); None otherwise."""
    p = params.get(pcs[0].param)
    if p is None or tuple(p.shape) != tuple(pcs[0].full_shape) or any(pc.param != pcs[0].param for pc in pcs):
        return None
    rows = 0
    for pc in sorted(pcs, key=lambda x: x.offset[0]):
        if pc.offset[0] != rows or tuple(pc.data.shape[1:]) != tuple(p.shape[1:]) or any(pc.offset[1:]):
            return None
        rows += pc.data.shape[0]
    if rows != p.shape[0]:
        return None
    for pc in pcs:
        v = p[pc.index()]
        if v.data_ptr() != pc.data.data_ptr() or v.shape != pc.data.shape or v.stride() != pc.data.stride():
            return None
    return p


def iter_hf_tensors(hf_dir: str) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of an HF checkpoint dir, one file at a time."""
    from safetensors import safe_open

    index = read_hf_index(hf_dir)
    by_file: dict[str, list[str]] = {}
    for k, fp in index.items():
        by_file.setdefault(fp, []).append(k)
    for fp in sorted(by_file):
        with safe_open(fp, framework="pt") as h:
            for k in sorted(by_file[fp]):
                yield k, h.get_tensor(k)


def load_hf_weights(models: list, family: ModelFamily, hf_config: JsonDict, hf_path: str, vocab_size: int) -> None:
    """The trainer's HF load: HF safetensors (all ``*.safetensors`` in ``hf_path``) -> the
    family's mapping (full 1-process Megatron tensors) -> this rank's slices of the model
    chunks ``models`` (:func:`sharding.load_full_state`; ``vocab_size``: the HF vocab rows,
    padding rows left zero). Collective at world size > 1 (the names used are gathered).

    When the files hold exactly the mapping table's HF on-disk names (the normal case),
    each rank reads only the HF tensors its own shards come from (``safe_open``; e.g. an
    EP rank reads its experts only), so host memory per rank is about its share of the
    model plus one full tensor. Otherwise (transformers' in-memory fused layout, stray or
    missing keys) every rank reads everything and the mapping raises naming the keys.
    Raises KeyError naming unused/missing HF tensors, local parameters with no source, or
    converted tensors that no rank of the world uses; ValueError on a shape mismatch
    (vocab padding excepted) or a tensor present in two files."""
    import contextlib

    import torch.distributed as dist
    from safetensors import safe_open
    from safetensors.torch import load_file

    from moe_async.errors import check_safetensors_file
    from moe_async.models import local_spec_name
    from moe_async.megatron.sharding import load_full_state, needed_names

    files = sorted(glob.glob(os.path.join(hf_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {hf_path}")
    where: dict[str, str] = {}
    for f in files:
        check_safetensors_file(f)  # a truncated/corrupt file is named (CheckpointReadError)
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                if k in where:
                    raise ValueError(f"tensor {k!r} appears in two safetensors files ({f})")
                where[k] = f
    from moe_async.models.deepseek_v3.hf_extras import hf_extras

    extras = hf_extras(hf_config, where)  # DeepSeek-V3: MTP keys skipped (logged), FP8 dequantized
    read_scale, where = extras.scale_reader(where), extras.weights(where)
    arch = family.arch_args(hf_config)
    table = family.table(arch)
    want = needed_names(models)  # 1-process local-spec names this rank slices from
    if set(where) == set(table.hf_keys):
        unknown = sorted(want - set(table.by_megatron))
        if unknown:
            raise KeyError(f"weight load: model params with no HF mapping: {unknown}")
        meg_local: dict[str, Tensor] = {}
        with contextlib.ExitStack() as stack:
            handles = {f: stack.enter_context(safe_open(f, framework="pt")) for f in files}
            for m in sorted(want):
                rule, hs = table.by_megatron[m]
                meg_local[m] = rule.fuse([extras.get_tensor(h, handles[where[h]].get_tensor(h), read_scale)
                                          for h in hs], arch)
    else:
        hf_state: dict[str, Tensor] = {}
        for f in files:
            hf_state.update(load_file(f))
        hf_state = extras.apply(hf_state)
        meg = family.hf_to_megatron(hf_state, hf_config)
        del hf_state
        # TE-spec names (fused norms) -> the local-spec names of the mapping table
        meg_local = {local_spec_name(k): v for k, v in meg.items()}
    load_full_state(models, meg_local, vocab_size)
    used = set(want)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(used))
        used = set().union(*map(set, everyone))
    unused = sorted(set(table.by_megatron) - used)
    if unused:
        raise KeyError(f"weight load: converted tensors used by no rank: {unused}")

"""Checkpoint conversion HF safetensors <-> Megatron ``torch_dist``, at any TP/PP/EP layout.

Used by ``tools/convert_hf_to_megatron.py`` and ``tools/convert_megatron_to_hf.py``. Both
directions go through the family's ONE declarative mapping table (``moe_async.models``:
``ModelFamily.table``) and the trainer's sharding helpers (``moe_async.trainer.sharding``:
per-rank slices read from Megatron's own ``sharded_state_dict()`` metadata), i.e. the same
path as ``MegatronTrainer``'s HF load and HF export; the Megatron model is built with the
same family helpers as the trainer (``transformer_config``, ``layer_spec``,
``gpt_model_kwargs``, ``padded_vocab_size``).

Before anything else both directions refuse, naming the flag and the config field, a
TP/PP/EP layout Megatron could not build the model at (:func:`check_layout`), and name the
file of any JSON input that does not parse (``config.json``, the safetensors index, the
checkpoint's ``hf_config.json`` / ``moe_async_convert.json``). The CLIs print such a refusal
as one ``error:`` line and exit with status 2.

HF -> Megatron (:func:`hf_to_megatron_checkpoint`): the HF config is checked against the
family spec first (``arch_args``; a mismatch raises ``ValueError`` naming the field). The
safetensors files (``model.safetensors.index.json`` when present, else ``*.safetensors``)
are read ONE FILE AT A TIME with ``safe_open``; a rank reads only the tensors its own shards
come from (an EP rank: its experts). A Megatron tensor whose HF sources span files (q/k/v,
gate/up) is fused once its last source has been read; the pending sources are all that is
kept between files. Transformers' in-memory fused expert layout (``experts.gate_up_proj``
``[E,2I,H]`` / ``experts.down_proj`` ``[E,H,I]``, ``mlp.gate``) is accepted too (each fused
tensor is rewritten to the per-expert on-disk names by the family's ``normalize_hf_state``).
Any HF key the table does not use, and any table source that no file holds, raises
``KeyError`` naming the keys BEFORE anything is written. The model's sharded state dict is
written with ``megatron.core.dist_checkpointing.save`` under the ``"model"`` key (the same
keys as ``MegatronTrainer.save_checkpoint``'s model part) by :func:`save_strategy`
(default: Megatron's torch_dist strategy with an in-process writer, no fsync unless asked),
SwiGLU fc1 tensors as one item each where their halves are contiguous
(:func:`whole_glu_tensors`), plus ``hf_config.json`` and ``moe_async_convert.json``
(family, vocab, the layout it was written at).

Megatron -> HF (:func:`megatron_to_hf_checkpoint`): builds the model at the requested
layout (any: ``torch_dist`` reshards on load), ``dist_checkpointing.load`` through
:func:`mmap_load_strategy` into the parameters; every checkpoint
tensor the model does not ask for raises ``KeyError`` (strict ``raise_unexpected``), every
model tensor missing from the checkpoint too (``raise_all``). Full tensors are gathered to
rank 0 one at a time (``gather_full_state``), split into HF names by the mapping table
(which raises naming any HF tensor left unset or Megatron tensor left unused), and written
as sharded safetensors of at most ``max_shard_size`` bytes each, with
``model.safetensors.index.json``; ``config.json``, generation config and tokenizer files
are copied from the reference HF dir. Host memory on rank 0: its model share + one output
file's worth of tensors.

Why not megatron-bridge / mbridge (evaluated 2026-11-29 in this repo's venv: Python 3.11,
CPU-only torch, megatron-core 0.16.1, transformers 5.23, no CUDA, no transformer_engine):
megatron-bridge 0.3.1 (latest on PyPI; 0.3.0 the only other) cannot be installed or imported
here: its wheel requires transformers<5.0 (this repo runs transformers 5.23, whose in-memory
MoE layout it does not know), transformer-engine[core_cu13,pytorch]>=2.10 (CUDA 13 builds),
mamba-ssm, causal-conv1d, nvidia-resiliency-ext, and with --no-deps ``import megatron.bridge``
fails at once in megatron/bridge/peft/lora_layers.py (``import transformer_engine.pytorch``,
ModuleNotFoundError) - it is a GPU-only library. mbridge 0.15.1 (latest) installs with
--no-deps and imports against megatron-core 0.16.1, but cannot build a model without
Transformer Engine: ``AutoBridge.from_config(...).get_model()`` calls
``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``, which fails on this
machine with ``NameError: name 'TENorm' is not defined`` (megatron-core's TE spec without TE);
past that it moves modules with ``.cuda(torch.cuda.current_device())`` (core/util.py) and
allocates its TP/PP broadcast buffers and export tensors on ``torch.cuda.current_device()``
(core/util.py, core/bridge.py), so neither load nor export runs without a GPU. It also only
moves weights between HF files and a live model (no torch_dist writer), reads for each
Megatron parameter the HF names its table asks for (an extra HF key is never reported), and
maps only the per-expert on-disk names (models/mixtral.py: ``experts.{e}.w1/w3``), not
transformers 5's fused ``experts.gate_up_proj``. So the conversion here reuses this repo's own mapping
table and Megatron's ``sharded_state_dict`` / ``dist_checkpointing`` (which do run on CPU
with gloo).

Public API:
    hf_to_megatron_checkpoint(hf_dir, out_dir, tp=1, pp=1, ep=1, progress=True, vocab_div=128,
                              save_threads=0, fsync=False) -> dict   (stats, incl. "phases" s)
    megatron_to_hf_checkpoint(megatron_dir, hf_config_dir, out_dir, max_shard_size="5GB",
                              tp=1, pp=1, ep=1, progress=True, vocab_div=None, fsync=False) -> dict
    check_layout(hf_cfg, tp, pp, ep, world=None)   ValueError naming flag + field
    check_out_dir(out_dir, flag="--out")   FileExistsError: a file, a non-empty dir, under a file
    read_torch_dist_metadata(megatron_dir)   DCP Metadata; errors name metadata.json / .metadata
    parallel_layout(tp, pp, ep)        context: process group + Megatron parallel state
    save_strategy(threads=0, fsync=False)  torch_dist save strategy used here (0: in-process)
    in_process_save_strategy(fsync=False)  Megatron's torch_dist strategy, in-process writer
    mmap_load_strategy(adopt=None, metadata=None)   torch_dist load strategy, mmap reader
    whole_glu_tensors(sharded_state_dict) -> int   contiguous SwiGLU fc1 factories -> 1 tensor
    read_json_file(path, what=""); read_hf_config(hf_dir) -> dict   (errors name the file)
    is_optimizer_key(key) -> bool      torch_dist key of Megatron optimizer state
    saved_vocab_rows(megatron_dir, metadata=None)   padded vocab rows of a torch_dist checkpoint
    build_model(hf_config, tp, pp, ep, params_dtype="fp32", vocab_div=128, padded_vocab=None)
        -> (GPTModel, hf_vocab_size)
    load_hf_into_model(model, hf_config, index, vocab_size)   (HF files -> this rank's shards)
    load_megatron_into_model(model, megatron_dir, metadata=None)   (strict torch_dist load)
    read_hf_index(hf_dir) -> dict[str, str]   (HF key -> file); iter_hf_tensors(hf_dir)
    ShardWriter(out_dir, max_bytes, fsync=False)   (sharded safetensors + index json)
    parse_size(text) -> int                   ("5GB" -> bytes)

Throughput (tools/bench_convert.py --family all --repeats 7: random fp32 models of ~345 MB in 4
safetensors files, 1 process, this 2-core CPU machine (ext4, load average 1-2), 2026-11-30
~02:00 UTC, two runs; ratio = plain safetensors read + write seconds / conversion seconds, per
round against a baseline run just before it, median of 7 rounds after a warm-up; goal >= 0.5):

    family       HF -> Megatron (run 1 / 2)   Megatron -> HF (run 1 / 2)
    mixtral           0.725 / 0.726               0.781 / 0.813
    qwen3_moe         0.753 / 0.754               0.764 / 0.798
    llama             1.044 / 1.111               1.257 / 1.409
    deepseek_v3       0.691 / 0.705               0.685 / 0.710

Every timed call there starts after the bench's page warm-up (see tools/bench_convert.py): this
machine is a VM that hands free pages back to its host after ~2 s (virtio_balloon free page
reporting), and the first write to such a page costs a host fault (~2 ms per MB). Without the
warm-up, whichever side of a pair drew those pages lost ~0.5 s per 345 MB: the Megatron -> HF
"slow mode" (0.2-0.3) of earlier runs was that, all kernel time in the copy into new page cache;
a third run with ``--no-warm-pages`` measured Megatron -> HF 0.36 / 0.36 / 0.49 / 0.32 and
HF -> Megatron 0.68 / 0.68 / 0.84 / 0.70 (same families, same order).
What made both directions faster:
every memory-mapped tensor read (HF safetensors views, .distcp items) is prefaulted with one
``madvise(MADV_POPULATE_READ)`` (:func:`prefault_read`; mixtral torch_dist save 0.185 -> 0.12 s,
HF write 0.19 -> 0.10 s); earlier: Megatron -> HF adopts the mapped 64-byte aligned ``.distcp``
items as the parameters (no copy), HF -> Megatron takes a fused SwiGLU fc1 as the parameter,
``CudaToCpuMode`` suspended in the copy loops, ``.metadata`` read once, in-process writer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import json
import math
import os
import re
import shutil
import time
from typing import Any, Iterator

import torch

from moe_async.models import get_family, hf_config_dict
from moe_async.megatron import container
from moe_async.megatron.te_spec_names import is_te_extra_state, match_checkpoint, to_te_names
from moe_async.models.deepseek_v3.hf_extras import hf_extras

Tensor = torch.Tensor

INDEX_NAME = "model.safetensors.index.json"
# Files copied from the reference HF dir next to the converted weights (when present).
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
META_NAME = "moe_async_convert.json"
# Byte alignment of each item in the .distcp files this module writes (padding between items,
# which DCP's offsets skip); torch.save aligns a tensor's data to 64 bytes within its item,
# so a memory-mapped read finds every tensor aligned and can use it in place.
ITEM_ALIGN = 64
# Megatron-Core's default make_vocab_size_divisible_by (Megatron-LM); only the stored shape
# depends on it, the HF tensors never (padding rows are zeros, dropped on export).
DEFAULT_VOCAB_DIV = 128
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
    ``.distcp`` item) whose pages are in the page cache: on this machine (Linux 6.18 VM),
    writing 345 MB to a file straight from a new private map of another took 0.26-0.28 s, and
    0.10 s after this advice (0.09 s from ordinary memory); the torch_dist save of HF ->
    Megatron and the safetensors write of Megatron -> HF read their tensors from such maps.
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


def parse_size(text: str | int) -> int:
    """``"5GB"`` / ``"500MB"`` / ``"10KB"`` / ``"123"`` -> bytes (powers of 1000, as
    transformers' ``max_shard_size``; ``GiB``/``MiB``/``KiB`` are powers of 1024)."""
    if isinstance(text, int):
        return text
    t = text.strip().upper()
    units = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def read_hf_index(hf_dir: str) -> dict[str, str]:
    """HF tensor name -> absolute file path, from ``model.safetensors.index.json`` when
    present (and every file it names must exist), else from the keys of every
    ``*.safetensors`` in ``hf_dir``. ValueError on a key in two files; CheckpointReadError
    (a ValueError) naming a truncated or corrupt safetensors file."""
    from safetensors import safe_open

    from moe_async.errors import check_safetensors_file

    idx = os.path.join(hf_dir, INDEX_NAME)
    if os.path.exists(idx):
        wm = _json_object(idx, "safetensors index").get("weight_map")
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


def _pbar(total: int, desc: str, enabled: bool, unit: str = "B"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=not enabled, leave=False)


# ----------------------------------------------------------------------------------- dist
def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


@contextlib.contextmanager
def parallel_layout(tp: int, pp: int, ep: int):
    """torch.distributed (gloo on CPU, NCCL with CUDA; world from ``WORLD_SIZE``/``RANK``/
    ``MASTER_ADDR``/``MASTER_PORT`` as set by torchrun; 1 process otherwise, with an
    in-memory ``HashStore`` instead of a TCP rendezvous) + Megatron parallel state at
    (tp, pp, ep) with ETP 1, the CPU compat mends and the CPU device scope.
    Destroys the Megatron parallel state (and the process group if it created it) on exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from moe_async.compat import apply_cpu_compat, cpu_device_scope, model_parallel_manual_seed

    own_pg = False
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if world == 1:  # no rendezvous needed (a TCP store costs ~0.1 s to start)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend, init_method="env://", rank=int(os.environ.get("RANK", "0")),
                                    world_size=world)
        own_pg = True
    if ps.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is already initialised in this process")
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of tp*pp={tp * pp}")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )
    try:
        apply_cpu_compat()
        with cpu_device_scope():
            model_parallel_manual_seed(1234)
            yield
    finally:
        ps.destroy_model_parallel()
        if own_pg:
            _destroy_process_groups()


@contextlib.contextmanager
def _no_device_scope():
    """Suspend the CPU compat layer's ``CudaToCpuMode`` (when it is the innermost torch
    function mode) for code that only moves CPU tensors and never names a CUDA device: the
    mode costs a Python call on every torch op and tensor attribute (``.shape``,
    ``.data_ptr()``), ~15k of them per conversion of a 4-layer MoE. No-op otherwise (CUDA,
    no mode, or another mode on top)."""
    from torch.overrides import _get_current_function_mode_stack

    from moe_async.compat import CudaToCpuMode

    stack = _get_current_function_mode_stack()
    if not stack or not isinstance(stack[-1], CudaToCpuMode):
        yield
        return
    from torch.overrides import _pop_mode_temporarily

    with _pop_mode_temporarily():
        yield


def _cpu_tensors_only(fn):
    """Decorator: run ``fn`` under :func:`_no_device_scope`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _no_device_scope():
            return fn(*args, **kwargs)

    return wrapper


def _destroy_process_groups() -> None:
    """``dist.destroy_process_group()`` with the groups' C++ teardown on another thread.

    Megatron's ``initialize_model_parallel`` creates ~20 groups even at 1 process; each gloo
    group's destructor joins its worker threads, which took 0.05-0.45 s in all on this
    shared 2-core machine, on the caller's clock. Here the destroy unregisters every group
    at once (the global state is clean when it returns: a new ``init_process_group`` works),
    while references to the group objects are kept and dropped on a background thread, where
    the destructors then run (they do not hold the GIL while joining); the interpreter waits
    for that thread at exit. At world size > 1 the
    default group (which owns the TCP store and its port) is still destroyed here. Without
    torch's ``distributed_c10d._world`` registry the destroy is plain."""
    import threading

    import torch.distributed as dist

    try:
        from torch.distributed import distributed_c10d as c10d

        keep = [pg for pg in list(c10d._world.pg_map)
                if dist.get_world_size() == 1 or pg is not dist.GroupMember.WORLD]
    except (AttributeError, ImportError):  # pragma: no cover - other torch versions
        keep = []
    dist.destroy_process_group()
    if keep:
        # not a daemon: the interpreter waits for it at exit (a group destroyed while the
        # process exits aborts it in C++: "terminate called without an active exception")
        threading.Thread(target=keep.clear, name="moe_async-release-process-groups", daemon=False).start()


def build_model(hf_config: Any, tp: int, pp: int, ep: int, *, params_dtype: str = "fp32",
                vocab_div: int = DEFAULT_VOCAB_DIV, padded_vocab: int | None = None):
    """This rank's ``GPTModel`` stage for ``hf_config`` at the current Megatron parallel
    state, built exactly as ``MegatronTrainer._build`` does (same family helpers, vocab
    padded to a multiple of ``vocab_div * tp``, or to ``padded_vocab`` rows when given).
    Returns ``(model, hf_vocab_size)``."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from moe_async.trainer.megatron_trainer import _have_te
    from moe_async.trainer.sharding import padded_vocab_size

    d = hf_config_dict(hf_config)
    fam = get_family(d.get("model_type"))
    tf = fam.transformer_config(
        d,
        params_dtype=params_dtype,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
    )
    # every parameter is overwritten by the load: allocate without the random init
    tf.perform_initialization = False
    kw = fam.gpt_model_kwargs(d)
    vocab = int(kw["vocab_size"])
    kw["vocab_size"] = padded_vocab if padded_vocab is not None else padded_vocab_size(vocab, tp, vocab_div)
    use_te = torch.cuda.is_available() and _have_te()
    model = GPTModel(
        config=tf,
        transformer_layer_spec=fam.layer_spec(d, use_te=use_te),
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=False,
        **kw,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model, vocab


# HF tensors kept in fp32 by Megatron whatever the params dtype (deepseek_v3's router bias is
# an fp32 buffer), so they may differ from the checkpoint's dtype.
FP32_ANYWAY = (".e_score_correction_bias",)


def _dtype_of(hf_cfg: dict, index: dict[str, str]) -> str:
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
@_cpu_tensors_only
def load_hf_into_model(model, hf_cfg: dict, index: dict[str, str], vocab_size: int,
                       progress: bool = True) -> dict[str, Any]:
    """Copy this rank's slices of the HF checkpoint (``index``: key -> file) into ``model``,
    one file at a time. Returns stats (bytes read by this rank, files). KeyError naming
    unused / missing HF keys (before any copy), local params with no source; ValueError on
    shape mismatch (vocab padding excepted) or an untied-in-config head that differs."""
    from safetensors import safe_open

    from moe_async.trainer.sharding import _fit_vocab, local_pieces

    fam = get_family(hf_cfg.get("model_type"))
    a = fam.arch_args(hf_cfg)
    table = fam.table(a)
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
    bar = _pbar(total, f"HF->Megatron rank {_rank()}", progress)
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
            p = _whole_param(pcs, tensors)
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


def save_strategy(threads: int = 0, fsync: bool = False):
    """The ``torch_dist`` save strategy used here. ``threads=0`` (default):
    :func:`in_process_save_strategy` (``fsync`` as given); ``threads>=1``: Megatron-Core's own
    ``TorchDistSaveShardedStrategy`` with ``threads`` forked writer processes per rank (it
    fsyncs every file whatever ``fsync`` says). At DP > 1 either is wrapped in
    ``FullyParallelSaveStrategyWrapper`` so that the replicated tensors' writes are spread
    over the data-parallel ranks instead of all falling to DP rank 0."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if threads < 0:
        raise ValueError(f"save threads must be >= 0, got {threads}")
    if threads == 0:
        st = in_process_save_strategy(fsync=fsync)
    else:
        st = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=threads)
    if ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        st = FullyParallelSaveStrategyWrapper(st, ps.get_data_parallel_group(with_context_parallel=True))
    return st


def in_process_save_strategy(fsync: bool = False):
    """A ``torch_dist`` save strategy that writes in the calling process.

    It is Megatron-Core's ``TorchDistSaveShardedStrategy`` (same key translation,
    ``MCoreSavePlanner``, decentralised plan, ``.metadata``, ``__<rank>_0.distcp`` file names,
    items serialised with ``torch.save`` by torch DCP's ``_write_item``: the output is an
    ordinary torch_dist checkpoint that ``dist_checkpointing.load`` reads at any layout) with
    a different writer (a ``FileSystemWriterAsync`` subclass): Megatron's writer starts a
    ``multiprocessing`` Manager process (spawn: a fresh interpreter, ~1-5 s on the first save
    of a process), forks ``thread_count`` writer processes per save and fsyncs every file;
    this one writes each rank's items into ONE file from the calling process, fsyncs the
    data file and ``.metadata`` only when ``fsync`` is set, and skips the CRC32 that
    ``torch.save`` computes per record (``torch.serialization.set_crc32_options(False)``
    while writing; ``torch.load``, which DCP uses to read items, never checks it). Write
    errors are returned to Megatron's finalisation as DCP's wrapped exceptions, so every rank
    raises ``CheckpointException``."""
    return _in_process_classes()[1](fsync=fsync)


@functools.cache
def _in_process_classes() -> tuple:
    """(writer class, strategy class), defined once Megatron-Core is imported."""
    import inspect

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_plan
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint.api import _wrap_exception
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _write_item
    from torch.distributed.checkpoint.planner import WriteItemType

    write_kw: dict[str, Any] = {}
    if "serialization_format" in inspect.signature(_write_item).parameters:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        write_kw["serialization_format"] = SerializationFormat.TORCH_SAVE  # what DCP's reader expects

    class InProcessWriter(FileSystemWriterAsync):
        """``FileSystemWriterAsync`` whose save function writes in the calling process."""

        def __init__(self, path, fsync: bool):
            super().__init__(path, sync_files=fsync, thread_count=1)
            self.fsync = fsync
            self.results: Any = None

        def prepare_write_data(self, plan, planner) -> None:
            byte_items, tensor_items = [], []
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    byte_items.append((item, data))
                    continue
                t = data.detach()
                if t.device.type != "cpu":
                    t = t.to("cpu")
                elif t.untyped_storage().nbytes() != t.numel() * t.element_size():
                    t = t.clone()  # torch.save would write the view's whole storage
                tensor_items.append((item, t))
            name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            self.write_buckets = ([(os.path.join(self.checkpoint_dir, name), name, (byte_items, tensor_items))]
                                  if byte_items or tensor_items else [])
            self.results_queue = None

        def get_save_function_and_args(self):
            if not self.write_buckets:
                self.results = []
                return None, None, []
            return self.write_in_process, None, []

        @_cpu_tensors_only
        def write_in_process(self) -> None:
            transforms = [self.transforms] if hasattr(self, "transforms") else []
            crc = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
            results = []
            try:
                for path, key, (byte_items, tensor_items) in self.write_buckets:
                    with open(path, "wb") as f:
                        for item, data in byte_items + tensor_items:
                            pad = -f.tell() % ITEM_ALIGN
                            if pad:  # items start aligned: a mapped read can use the data in place
                                f.write(b"\0" * pad)
                            results.append(_write_item(*transforms, f, data, item, key, **write_kw))
                        if self.fsync:
                            f.flush()
                            os.fsync(f.fileno())
                self.results = results
            except Exception as e:  # noqa: BLE001 - handed to Megatron's finalisation (raised on every rank)
                self.results = _wrap_exception(e)
            finally:
                torch.serialization.set_crc32_options(crc)

        def retrieve_write_results(self):
            if self.results is None:
                return _wrap_exception(RuntimeError("torch_dist in-process writer: nothing was written"))
            return self.results

    class InProcessSaveStrategy(TorchDistSaveShardedStrategy):
        """``TorchDistSaveShardedStrategy`` with :class:`InProcessWriter` (no cached plans)."""

        def __init__(self, fsync: bool = False):
            super().__init__("torch_dist", 1, thread_count=1)
            self.fsync = fsync

        def async_save(self, sharded_state_dict, checkpoint_dir):
            # Megatron-Core 0.16.1 TorchDistSaveShardedStrategy.async_save, with another writer
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica)
            pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
            writer = InProcessWriter(checkpoint_dir, self.fsync)
            ret = save_state_dict_async_plan(
                pyt_state_dict, writer, None, 0,
                planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                         flatten_state_dict=False),
            )
            return self._get_save_and_finalize_callbacks(writer, ret[0])

    return InProcessWriter, InProcessSaveStrategy


@_cpu_tensors_only
def whole_glu_tensors(sharded_state_dict: dict) -> int:
    """Replace, in place, each Megatron SwiGLU ``linear_fc1`` ``ShardedTensorFactory`` whose two
    halves (gate ``w``, up ``v``) are, in this order, ONE contiguous range of the global
    tensor (experts at ETP 1 at any TP; dense fc1 at TP 1) by one ``ShardedTensor`` of the
    whole local tensor (same key, global shape and offsets). Megatron's factory splits such a
    tensor into two views on save (which its writer clones: ``torch.save`` of a view writes
    the whole storage) and loads two halves that ``torch.cat`` merges into a new tensor; the
    whole tensor saves without a copy, loads in place, and is stored as one item covering the
    same elements, which DCP reads back at any layout (including through the factory).
    Other factories are left alone. Returns how many were replaced."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    n = 0

    def visit(d):
        nonlocal n
        items = d.items() if isinstance(d, dict) else enumerate(d)
        for k, v in list(items):
            if isinstance(v, (dict, list)):
                visit(v)
            elif isinstance(v, ShardedTensorFactory) and v.flattened_range is None and v.data is not None:
                w_v = v.build()
                if not (isinstance(w_v, list) and len(w_v) == 2 and all(isinstance(x, ShardedTensor) for x in w_v)):
                    continue
                w, u = w_v
                ax = w.prepend_axis_num
                whole = (w.key == u.key == v.key and u.prepend_axis_num == ax and w.flattened_range is None
                         and u.flattened_range is None and w.global_offset[ax] == 0
                         and u.global_offset[ax] == w.local_shape[0]
                         and w.global_shape[ax] == w.local_shape[0] + u.local_shape[0] == v.data.shape[0]
                         and w.global_shape == u.global_shape
                         and w.global_offset[:ax] == u.global_offset[:ax]
                         and w.global_offset[ax + 1:] == u.global_offset[ax + 1:]
                         and w.data.data_ptr() == v.data.data_ptr())
                if not whole:
                    continue
                frag = list(w.axis_fragmentations)
                frag[ax] = 1
                d[k] = ShardedTensor(w.key, v.data, v.data.dtype, tuple(v.data.shape), w.global_shape,
                                     w.global_offset, tuple(frag), w.replica_id, ax,
                                     allow_shape_mismatch=w.allow_shape_mismatch)
                n += 1

    visit(sharded_state_dict)
    return n


class _Clock:
    """Seconds per named step: ``mark(name)`` records the time since the previous mark."""

    def __init__(self):
        self.t = time.perf_counter()
        self.t0 = self.t
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.t
        self.t = now

    def total(self) -> float:
        return time.perf_counter() - self.t0


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


def _json_object(path: str, what: str) -> dict:
    d = read_json_file(path, what)
    if not isinstance(d, dict):
        raise ValueError(f"{path} ({what}) holds a JSON {type(d).__name__}, not an object")
    return d


def read_hf_config(hf_dir: str) -> dict:
    """``hf_dir/config.json`` as a dict; FileNotFoundError / ValueError naming the file."""
    p = os.path.join(hf_dir, "config.json") if os.path.isdir(hf_dir) else hf_dir
    if not os.path.exists(p):
        raise FileNotFoundError(f"no HF config: {p} does not exist")
    return _json_object(p, "HF config")


def check_out_dir(out_dir: str, flag: str = "--out") -> None:
    """Refuse an output dir that cannot take a conversion: FileExistsError naming ``flag`` and
    the path when it is an existing file, a non-empty directory, or lies under a file."""
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise FileExistsError(f"{flag} {out_dir} is an existing file, not a directory")
        if os.listdir(out_dir):
            raise FileExistsError(f"{flag} {out_dir} exists and is not empty")
        return
    up = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.exists(up):
        up = os.path.dirname(up)
    if not os.path.isdir(up):
        raise FileExistsError(f"{flag} {out_dir} cannot be created: {up} is a file, not a directory")


def _layout_world() -> int:
    """World size of this run: the process group's, else ``WORLD_SIZE`` (torchrun), else 1."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_layout(hf_cfg: dict, tp: int, pp: int, ep: int, world: int | None = None) -> None:
    """Refuse, before any process group or model exists, a layout Megatron cannot build the
    model of ``hf_cfg`` at, naming the flag and the config field. ValueError when: a size is
    not a positive integer; ``--tp`` does not divide the attention heads, the query groups
    (``num_key_value_heads``; not for MLA), the dense MLP width (``intermediate_size``, when
    the model has dense MLP layers) or the shared-expert width; ``--pp`` does not divide the
    layers; ``--ep`` does not divide the routed experts (or is > 1 for a dense model); the
    world (``world``, default: this run's, see :func:`_layout_world`) is not a multiple of
    ``tp * pp`` or of ``ep * pp`` (expert TP is 1; Megatron's own rules,
    ``parallel_state.initialize_model_parallel``). All problems are listed in one message."""
    for flag, v in (("--tp", tp), ("--pp", pp), ("--ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} must be a positive integer, got {v!r}")
    world = _layout_world() if world is None else world
    fam = get_family(hf_cfg.get("model_type"))
    a = fam.arch_args(hf_cfg)
    tf = fam.transformer_config(hf_cfg)  # at TP/PP/EP 1: Megatron's own numbers of this model
    errs = []
    if tf.num_attention_heads % tp:
        errs.append(f"--tp {tp} does not divide num_attention_heads={tf.num_attention_heads}")
    mla = bool(getattr(tf, "multi_latent_attention", False))
    if not mla and tf.num_query_groups and tf.num_query_groups % tp:
        errs.append(f"--tp {tp} does not divide num_key_value_heads={tf.num_query_groups} (Megatron's query groups)")
    freq = getattr(tf, "moe_layer_freq", 1)
    has_dense = not tf.num_moe_experts or (isinstance(freq, list) and 0 in freq)
    if has_dense and tf.ffn_hidden_size % tp:
        errs.append(f"--tp {tp} does not divide the dense MLP width intermediate_size={tf.ffn_hidden_size}")
    shared = getattr(tf, "moe_shared_expert_intermediate_size", None)
    if shared and shared % tp:
        errs.append(f"--tp {tp} does not divide the shared-expert width {shared}")
    if tf.num_layers % pp:
        errs.append(f"--pp {pp} does not divide num_hidden_layers={tf.num_layers}")
    if a.num_experts:
        if a.num_experts % ep:
            errs.append(f"--ep {ep} does not divide num_experts={a.num_experts}")
    elif ep > 1:
        errs.append(f"--ep {ep}: {a.model_type} has no experts (use --ep 1)")
    if world % (tp * pp):
        errs.append(f"the world size {world} (processes) is not a multiple of --tp x --pp = {tp * pp}")
    if world % (ep * pp):
        errs.append(f"the world size {world} (processes) is not a multiple of --ep x --pp = {ep * pp}")
    if errs:
        hint = (f" (run it under torchrun --nproc_per_node N with N a multiple of "
                f"{math.lcm(tp * pp, ep * pp)})" if any("world size" in e for e in errs) else "")
        raise ValueError(f"layout tp={tp} pp={pp} ep={ep} (world {world}) refused for {a.model_type}: "
                         + "; ".join(errs) + hint)


def _padded_vocab(vocab: int, tp: int, vocab_div: int) -> int:
    from moe_async.trainer.sharding import padded_vocab_size

    return padded_vocab_size(vocab, tp, vocab_div)


def hf_to_megatron_checkpoint(hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1, ep: int = 1,
                              progress: bool = True, vocab_div: int = DEFAULT_VOCAB_DIV,
                              save_threads: int = 0, fsync: bool = False) -> dict[str, Any]:
    """HF checkpoint dir -> Megatron torch_dist checkpoint at layout (tp, pp, ep) (the
    world is the torchrun world, 1 process otherwise; DP = world / (tp*pp)), in Megatron-LM's
    container (``out_dir/latest_checkpointed_iteration.txt`` = 0, the torch_dist files in
    ``out_dir/iter_0000000/``, ``common.pt`` with ``iteration`` and ``args``:
    :mod:`moe_async.megatron.container`) under the Transformer Engine spec's key names
    (:mod:`moe_async.megatron.te_spec_names`); a DeepSeek-V3 release's MTP keys are skipped
    (logged) and its FP8 weights dequantized (:mod:`moe_async.models.deepseek_v3.hf_extras`); written by
    :func:`save_strategy` ``(save_threads, fsync)`` (default: in the calling process, no
    fsync). The layout (:func:`check_layout`), the HF config (family spec) and the HF keys
    are checked before any process group, model or file exists. Returns stats on every
    rank: ``seconds``, ``phases`` (seconds per step), ``bytes_read`` (summed over ranks),
    ``hf_bytes``, ``world``."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    clock = _Clock()
    hf_cfg = read_hf_config(hf_dir)
    fam = get_family(hf_cfg.get("model_type"))
    a = fam.arch_args(hf_cfg)  # refuses an unsupported config, naming the field
    check_layout(hf_cfg, tp, pp, ep)
    check_out_dir(out_dir)
    index = read_hf_index(hf_dir)
    extras = hf_extras(hf_cfg, index)  # DeepSeek-V3: MTP keys skipped (logged), FP8 weights + scales
    check_hf_keys(fam, a, extras.weights(index))  # refuse unused / missing keys before building anything
    dtype = _dtype_of(hf_cfg, extras.plain(index))
    hf_bytes = sum(os.path.getsize(p) for p in set(index.values()))
    clock.mark("checks_s")
    with parallel_layout(tp, pp, ep):
        clock.mark("setup_s")
        model, vocab = build_model(hf_cfg, tp, pp, ep, params_dtype=dtype, vocab_div=vocab_div)
        clock.mark("build_s")
        stats = load_hf_into_model(model, hf_cfg, index, vocab, progress=progress and _rank() == 0)
        clock.mark("read_map_copy_s")
        root, out_dir = out_dir, container.iteration_dir(out_dir, 0)  # Megatron-LM's container
        if _rank() == 0:
            check_out_dir(root)
            os.makedirs(out_dir, exist_ok=True)
        dist.barrier()
        sd = model.sharded_state_dict()
        to_te_names(sd)  # the TE spec's key names on any machine
        whole_glu_tensors(sd)
        common = container.common_state(0, container.megatron_lm_args(
            a, tp=tp, pp=pp, ep=ep, padded_vocab_size=_padded_vocab(vocab, tp, vocab_div), vocab_div=vocab_div, params_dtype=dtype,
            world=_world(), iteration=0, extra=container.family_config_args(fam, a)))
        dist_checkpointing.save({"model": sd, **common}, out_dir, sharded_strategy=save_strategy(save_threads, fsync))
        clock.mark("torch_dist_save_s")
        t = torch.tensor([float(stats["bytes_read"])], dtype=torch.float64)
        dist.all_reduce(t)
        if _rank() == 0:
            meta = {
                "format": "moe_async megatron torch_dist (model only)",
                "model_type": hf_cfg["model_type"],
                "vocab_size": vocab,
                "params_dtype": dtype,
                "vocab_div": vocab_div,
                "saved_layout": {"tp": tp, "pp": pp, "ep": ep, "world": _world()},
            }
            for name, obj in (("hf_config.json", hf_cfg), (META_NAME, meta)):
                with open(os.path.join(out_dir, name), "w") as f:
                    json.dump(obj, f, indent=2, sort_keys=True)
                    if fsync:
                        f.flush()
                        os.fsync(f.fileno())
            container.write_tracker(root, 0, fsync)  # last: the iteration dir is complete
        dist.barrier()
        world = _world()
        clock.mark("finish_s")
        del model, sd
        clock.mark("free_s")
    clock.mark("teardown_s")
    return {"seconds": clock.total(), "phases": clock.phases, "bytes_read": float(t.item()), "hf_bytes": hf_bytes,
            "world": world}



def mmap_load_strategy(adopt: list[Tensor] | None = None, metadata=None):
    """A ``torch_dist`` load strategy that reads tensor items through a memory map.

    Megatron-Core's ``TorchDistLoadShardedStrategy`` (same key translation, ``MCoreLoadPlanner``,
    ``torch.distributed.checkpoint.load_state_dict``: any saved layout, strict handling as
    usual) with a ``CachedMetadataFileSystemReader`` subclass whose ``read_data`` maps each
    ``.distcp`` file once (``torch.UntypedStorage.from_file``, private mapping) and
    deserialises each tensor item with the storage pointing into the map, as ``torch.load(...,
    mmap=True)`` does for a whole file (``torch.serialization._load`` with
    ``overall_storage``, weights-only unpickler): the one copy is then from the page cache
    into the target tensor, where DCP's ``FileSystemReader`` reads each item into a new
    buffer (``torch.load`` of the file slice) and then copies that into the target. Items
    with DCP storage transforms, byte items, and a torch without this private API go the
    stock way.

    ``adopt``: whole tensors (a model's parameters) that need not be written at all: a
    request whose target is one of them, whole, read from ONE item of the same dtype and
    shape (contiguous, aligned) leaves the target untouched and records the mapped item in
    the strategy's ``adopted`` (``{target data_ptr: mapped tensor}``, filled by ``load``);
    the caller must then re-point each such tensor (``p.data = adopted[p.data_ptr()]``), or
    it keeps its old, unread contents. The mapping is private (copy-on-write): writes to an
    adopted tensor never reach the file, and the file may be removed while it is in use.

    ``metadata``: the checkpoint's DCP ``Metadata`` already read (:func:`read_torch_dist_metadata`),
    used instead of reading ``.metadata`` again. A ``.distcp`` file shorter than its items'
    extents, or an item that does not deserialise, is a ValueError naming the file."""
    return _mmap_classes()[1](adopt=adopt, metadata=metadata)


@functools.cache
def _mmap_classes() -> tuple:
    """(reader class, load strategy class, common-state load strategy class), defined once
    Megatron-Core is imported."""
    import inspect
    from typing import cast

    import torch.serialization as ts
    from megatron.core.dist_checkpointing.mapping import ShardedTensor as McoreShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner,
        TorchDistLoadShardedStrategy,
        _replace_sharded_keys_with_state_dict_keys,
        _replace_state_dict_keys_with_sharded_keys,
        _restore_dict_types,
        _unwrap_pyt_sharded_tensor,
        mcore_to_pyt_state_dict,
    )
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
    from torch.distributed import checkpoint
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.checkpoint.planner import LoadItemType

    have_mmap_load = (hasattr(ts, "_load") and "overall_storage" in inspect.signature(ts._load).parameters
                      and hasattr(torch._C, "PyTorchFileReader") and hasattr(ts, "_weights_only_unpickler"))

    class MmapReader(CachedMetadataFileSystemReader):
        """``FileSystemReader`` reading tensor items from a memory map of their file.

        ``adoptable``: ``{data_ptr: tensor}`` of whole tensors (parameters) that may take the
        mapped item itself instead of a copy of it; such targets are left unwritten and listed
        in ``adopted`` (``{data_ptr: mapped tensor}``) for the caller to re-point."""

        def __init__(self, *args, adoptable: dict[int, Tensor] | None = None, metadata=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.adoptable = adoptable or {}
            self.adopted: dict[int, Tensor] = {}
            self._cached_metadata = metadata

        def _adopt(self, req, target: Tensor, t: Tensor) -> bool:
            # the target must be the whole adoptable tensor (possibly viewed with Megatron's
            # prepended layer / expert axes), read from one contiguous, aligned item region
            p = self.adoptable.get(target.data_ptr())
            if (p is None or target.data_ptr() in self.adopted or p.numel() != target.numel()
                    or not p.is_contiguous() or not target.is_contiguous() or not t.is_contiguous()
                    or p.dtype != target.dtype or t.dtype != target.dtype or t.shape != target.shape
                    or t.data_ptr() % ITEM_ALIGN):
                return False
            self.adopted[target.data_ptr()] = t.view(p.shape)
            return True

        @_cpu_tensors_only
        def read_data(self, plan, planner):
            if not have_mmap_load:
                return super().read_data(plan, planner)
            per_file: dict[str, list] = {}
            stock = []
            for req in plan.items:
                md = self.storage_data[req.storage_index]
                if req.type == LoadItemType.BYTE_IO or md.transform_descriptors:
                    stock.append(req)
                else:
                    per_file.setdefault(md.relative_path, []).append(req)
            for rel, reqs in per_file.items():
                path = str(self.fs.concat_path(self.path, rel))
                size = os.path.getsize(path)
                end = max(self.storage_data[r.storage_index].offset + self.storage_data[r.storage_index].length
                          for r in reqs)
                if size < end:
                    raise ValueError(f"{path} (torch_dist data) is truncated: {size} bytes, its items in "
                                     f".metadata end at byte {end}")
                mapped = torch.UntypedStorage.from_file(path, False, size)
                with open(path, "rb") as stream:
                    for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                        md = self.storage_data[req.storage_index]
                        try:
                            zf = torch._C.PyTorchFileReader(self._slice_file(stream, md))
                            t = ts._load(zf, "cpu", ts._weights_only_unpickler,
                                         overall_storage=mapped[md.offset: md.offset + md.length])
                        except Exception as e:  # noqa: BLE001 - zip / unpickling errors of a corrupt item
                            raise ValueError(f"{path} (torch_dist data): the item at byte {md.offset} "
                                             f"({md.length} bytes) cannot be read, corrupt file: "
                                             f"{type(e).__name__}: {e}") from None
                        prefault_read(t)  # the item's pages, read by the copy or, adopted, by the HF write
                        t = narrow_tensor_by_index(t, req.storage_offsets, req.lengths)
                        target = planner.resolve_tensor(req).detach()
                        if target.size() != t.size():
                            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {t.size()}")
                        if not self._adopt(req, target, t):
                            target.copy_(t)
                        planner.commit_tensor(req, target)
                del mapped
            if stock:
                return super().read_data(dataclasses.replace(plan, items=stock), planner)
            fut = torch.futures.Future()
            fut.set_result(None)
            return fut

    class MmapLoadStrategy(TorchDistLoadShardedStrategy):
        """``TorchDistLoadShardedStrategy`` reading through :class:`MmapReader`."""

        def __init__(self, adopt: list[Tensor] | None = None, metadata=None):
            super().__init__()
            self.adoptable = {t.data_ptr(): t for t in (adopt or ()) if t.numel()}
            self.adopted: dict[int, Tensor] = {}
            self.metadata = metadata

        def load_tensors_metadata(self, checkpoint_dir, metadata=None):
            return super().load_tensors_metadata(checkpoint_dir, metadata or self.metadata)

        def load_sharded_metadata(self, checkpoint_dir):
            if self.metadata is None:
                return super().load_sharded_metadata(checkpoint_dir)
            # Megatron-Core 0.16.1 TorchDistLoadShardedStrategy.load_sharded_metadata, on the
            # metadata already read
            out = {}
            for key, smd in self.metadata.state_dict_metadata.items():
                if isinstance(smd, BytesStorageMetadata):
                    obj = ShardedObject.empty_from_unique_key(key)
                    out[obj.unique_key] = obj
            out.update(self.load_tensors_metadata(checkpoint_dir, self.metadata))
            return out

        def load(self, sharded_state_dict, checkpoint_dir):
            # Megatron-Core 0.16.1 TorchDistLoadShardedStrategy.load, with another reader
            shape_checked = [t for t in nested_values(sharded_state_dict)
                             if isinstance(t, McoreShardedTensor) and not t.allow_shape_mismatch]
            shape_free = {t.key: t for t in nested_values(sharded_state_dict)
                          if isinstance(t, McoreShardedTensor) and t.allow_shape_mismatch}
            orig = sharded_state_dict
            sharded_state_dict, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict)
            pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
            reader = MmapReader(checkpoint_dir, adoptable=self.adoptable, metadata=self.metadata)
            try:
                checkpoint.load_state_dict(pyt_state_dict, reader, planner=MCoreLoadPlanner(
                    shapes_validation_sharded_tensors=shape_checked, allow_shape_mismatch_sharded_tensors=shape_free))
            except CheckpointException as e:  # DCP wraps each rank's error: raise a file-naming one as is
                for exc in e.failures.values():
                    exc = exc[0] if isinstance(exc, tuple) else exc
                    if isinstance(exc, ValueError):
                        raise exc from None
                raise
            self.adopted = reader.adopted
            self.cached_global_metadata = reader.read_metadata()
            out = {k: _unwrap_pyt_sharded_tensor(v) for k, v in cast(dict, pyt_state_dict).items()}
            out = _replace_sharded_keys_with_state_dict_keys(out, flat_mapping, rename_mapping)
            _restore_dict_types(out, orig)
            return out

    class CommonLoadStrategy(TorchCommonLoadStrategy):
        """Megatron's ``common.pt`` loader with a truncated or corrupt file named in the error."""

        def load_common(self, checkpoint_dir):
            try:
                return super().load_common(checkpoint_dir)
            except CheckpointingException:
                raise
            except Exception as e:  # noqa: BLE001 - torch.load raises many kinds on a cut file
                p = os.path.join(str(checkpoint_dir), COMMON_STATE_FNAME)
                raise ValueError(f"{p} (torch_dist common state) cannot be read, truncated or corrupt: "
                                 f"{type(e).__name__}: {e}") from None

    return MmapReader, MmapLoadStrategy, CommonLoadStrategy


# ------------------------------------------------------------------------- Megatron -> HF
def load_megatron_into_model(model, megatron_dir: str, metadata=None) -> None:
    """``dist_checkpointing.load`` of the ``model`` part of a torch_dist checkpoint into
    ``model`` (any saved layout), read by :func:`mmap_load_strategy` straight into the
    parameters, or, where one aligned item holds a whole parameter, with the parameter
    re-pointed at the item in the file's private map (no copy at all): SwiGLU fc1 tensors whole (:func:`whole_glu_tensors`), the vocab-padded
    tensors not zero-filled first when the checkpoint has the model's padded shape, and the
    final ``load_state_dict`` copying only tensors that were not loaded in place. KeyError
    naming checkpoint tensors the model does not use or model tensors absent from the
    checkpoint. ``metadata``: the checkpoint's :func:`read_torch_dist_metadata` (read when
    not given; used for every metadata lookup of the load). A truncated or corrupt
    ``metadata.json``, ``.metadata``, ``common.pt`` or ``.distcp`` file is a ValueError naming
    the file."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if metadata is None:
        metadata = read_torch_dist_metadata(megatron_dir)
    sd = model.sharded_state_dict()
    match_checkpoint(sd, metadata.state_dict_metadata)  # either spec's key names
    whole_glu_tensors(sd)
    md = metadata.state_dict_metadata
    for t in nested_values(sd):
        # Megatron zero-fills a vocab-padded tensor before the load (rows the checkpoint may
        # lack); at the saved padded shape every element is read
        if (isinstance(t, ShardedTensor) and t.allow_shape_mismatch and t.key in md
                and tuple(getattr(md[t.key], "size", ())) == tuple(t.global_shape)):
            t.allow_shape_mismatch = False
    # Megatron's naming: "unexpected" = requested by the model but absent from the checkpoint,
    # "missing" = in the checkpoint but not requested.
    # the plain tensors' targets may take the mapped items themselves (no copy): re-pointed below
    strategy = mmap_load_strategy(adopt=[t.data for t in nested_values(sd) if isinstance(t, ShardedTensor)
                                         and t.flattened_range is None], metadata=metadata)
    loaded, in_ckpt_only, absent = dist_checkpointing.load(
        {"model": sd}, megatron_dir, sharded_strategy=strategy, common_strategy=_mmap_classes()[2](),
        strict=StrictHandling.RETURN_ALL,
    )
    repointed = _adopt_mapped(model, strategy)
    missing = sorted(absent)
    # optimizer state saved by MegatronTrainer.save_checkpoint is not a model tensor
    unexpected = sorted(k for k in in_ckpt_only if not is_optimizer_key(k) and not is_te_extra_state(k))
    if missing or unexpected:
        raise KeyError(
            "Megatron -> HF conversion: "
            + (f"model tensors missing from the checkpoint {missing[:20]} (of {len(missing)}); " if missing else "")
            + (f"unused checkpoint tensors {unexpected[:20]} (of {len(unexpected)})" if unexpected else "")
        )
    state = model.state_dict(keep_vars=True)
    got = loaded["model"]
    # a module's extra state that its sharded_state_dict leaves out (Megatron's output layer,
    # ColumnParallelLinear without TE: None) is nothing to load
    extra = {k for k in set(state) - set(got) if k.endswith("._extra_state") and state[k] is None}
    if set(got) != set(state) - extra:  # let load_state_dict name the difference
        model.load_state_dict({k: state[k] if isinstance(v, Tensor) and v.data_ptr() in repointed and k in state else v
                               for k, v in got.items()})
        return

    def in_place(k: str) -> bool:
        v, p = got[k], state[k]
        return (isinstance(v, Tensor) and isinstance(p, Tensor)
                and repointed.get(v.data_ptr(), v.data_ptr()) == p.data_ptr()
                and v.dtype == p.dtype and v.shape == p.shape and v.stride() == p.stride())

    rest = {k: v for k, v in got.items() if not in_place(k)}
    res = model.load_state_dict(rest, strict=False)
    if res.unexpected_keys or set(res.missing_keys) - (set(got) - set(rest)) - extra:  # pragma: no cover
        raise KeyError(f"Megatron -> HF conversion: load_state_dict {res}")


def _adopt_mapped(model, strategy) -> dict[int, int]:
    """After a load by ``mmap_load_strategy(adopt=...)``: each parameter / buffer of ``model``
    whose (unwritten) storage a mapped item was adopted for takes that item as its data
    (``p.data = item``); an adopted target that is no parameter of ``model`` gets the item
    copied into it instead. Returns ``{old data_ptr: new data_ptr}`` of the re-pointed tensors."""
    adopted = dict(strategy.adopted)
    moved: dict[int, int] = {}
    for _, p in list(model.named_parameters()) + list(model.named_buffers()):
        t = adopted.pop(p.data_ptr(), None) if p.numel() else None
        if t is None:
            continue
        if p.shape != t.shape or p.dtype != t.dtype or p.stride() != t.stride():  # pragma: no cover - checked on read
            strategy.adoptable[p.data_ptr()].copy_(t)
            continue
        moved[p.data_ptr()] = t.data_ptr()
        p.data = t
    for ptr, t in adopted.items():  # targets that are views of no parameter
        strategy.adoptable[ptr].copy_(t)
    strategy.adopted = {}
    return moved


def is_optimizer_key(key: str) -> bool:
    """True for a torch_dist tensor key of Megatron optimizer state: ``optimizer.*`` (one
    optimizer) or ``chained_<i>.optimizer.*`` (``ChainedOptimizer``: dense + expert)."""
    return re.match(r"(chained_\d+\.)?optimizer\.", key) is not None


def read_torch_dist_metadata(megatron_dir: str):
    """DCP ``Metadata`` of the torch_dist checkpoint in ``megatron_dir`` (its ``.metadata``
    file), after reading Megatron's ``metadata.json`` as JSON. FileNotFoundError naming the
    dir when either file is absent; ValueError naming the file when it does not parse
    (truncated or corrupt)."""
    from torch.distributed.checkpoint import FileSystemReader

    mj = os.path.join(megatron_dir, "metadata.json")
    if not os.path.exists(mj):
        raise FileNotFoundError(f"{megatron_dir} is not a Megatron torch_dist checkpoint: no metadata.json")
    if "sharded_backend" not in _json_object(mj, "Megatron checkpoint metadata"):
        raise ValueError(f"{mj} (Megatron checkpoint metadata) has no 'sharded_backend': not written by "
                         "megatron.core.dist_checkpointing")
    p = os.path.join(megatron_dir, ".metadata")
    if not os.path.exists(p):
        raise FileNotFoundError(f"{megatron_dir} is not a complete torch_dist checkpoint: no .metadata file")
    try:
        return FileSystemReader(megatron_dir).read_metadata()
    except Exception as e:  # noqa: BLE001 - pickle raises many kinds on a cut or corrupt file
        raise ValueError(f"{p} (torch_dist metadata) cannot be read, truncated or corrupt: "
                         f"{type(e).__name__}: {e}") from None


def saved_vocab_rows(megatron_dir: str, metadata=None) -> int | None:
    """Rows of the saved (padded) embedding / output layer of a torch_dist checkpoint
    (``metadata``: its :func:`read_torch_dist_metadata`, read when not given)."""
    md = (metadata or read_torch_dist_metadata(megatron_dir)).state_dict_metadata
    for k in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if k in md and hasattr(md[k], "size"):
            return int(md[k].size[0])
    return None


def _checkpoint_dtype(megatron_dir: str, meta: dict | None = None, metadata=None) -> str:
    """``"fp32"`` / ``"bf16"``: ``params_dtype`` of the conversion metadata when given, else
    the dtype of the saved word embedding."""
    if meta and "params_dtype" in meta:
        return meta["params_dtype"]
    md = (metadata or read_torch_dist_metadata(megatron_dir)).state_dict_metadata
    for k, m in md.items():
        if k.endswith("word_embeddings.weight") and hasattr(m, "properties"):
            return "bf16" if m.properties.dtype == torch.bfloat16 else "fp32"
    return "fp32"


class ShardWriter:
    """Writes ``(name, tensor)`` pairs into ``model-XXXXX-of-YYYYY.safetensors`` files of at
    most ``max_bytes`` each (a larger tensor gets a file of its own), then renames them and
    writes ``model.safetensors.index.json`` (``metadata.total_size`` = tensor bytes)."""

    def __init__(self, out_dir: str, max_bytes: int, fsync: bool = False):
        self.out_dir, self.max_bytes, self.fsync = out_dir, max_bytes, fsync
        # safetensors (0.8) creates its files 0600; each written file is given the mode any
        # other new file gets here (0666 less the umask), like the index and side files
        mask = os.umask(0)
        os.umask(mask)
        self.file_mode = 0o666 & ~mask
        self.buf: dict[str, Tensor] = {}
        self.buf_bytes = 0
        self.files: list[list[str]] = []
        self.total = 0

    def add(self, name: str, t: Tensor) -> None:
        n = t.numel() * t.element_size()
        if name in self.buf or any(name in f for f in self.files):
            raise KeyError(f"HF tensor {name!r} written twice")
        if self.buf and self.buf_bytes + n > self.max_bytes:
            self.flush()
        self.buf[name] = t.contiguous()
        self.buf_bytes += n
        self.total += n

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.buf:
            return
        i = len(self.files)
        path = os.path.join(self.out_dir, f".part-{i:05d}.safetensors")
        save_file(self.buf, path, metadata={"format": "pt"})
        os.chmod(path, self.file_mode)
        if self.fsync:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self.files.append(list(self.buf))
        self.buf, self.buf_bytes = {}, 0

    def close(self) -> list[str]:
        self.flush()
        n = len(self.files)
        names = []
        weight_map = {}
        for i, keys in enumerate(self.files):
            fn = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, f".part-{i:05d}.safetensors"), os.path.join(self.out_dir, fn))
            names.append(fn)
            weight_map.update({k: fn for k in keys})
        if n > 1:
            with open(os.path.join(self.out_dir, INDEX_NAME), "w") as f:
                json.dump({"metadata": {"total_size": self.total},
                           "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        return names


def _whole_param(pcs: list, params: dict[str, Tensor]) -> Tensor | None:
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


def _full_state(model, vocab_size: int) -> Iterator[tuple[str, Tensor]]:
    """:func:`moe_async.trainer.sharding.gather_full_state` to rank 0, with a copy-free path
    at world size 1: a tensor held whole by one local piece is yielded as that piece (a view
    of the parameter, vocab padding sliced off) instead of being copied into a new buffer;
    tensors made of several local pieces are assembled, each element exactly once
    (ValueError otherwise). Same names, order and values as ``gather_full_state``."""
    from moe_async.trainer.sharding import VOCAB_PARAMS, gather_full_state, local_pieces

    if _world() > 1:
        yield from gather_full_state(model, vocab_size, dst=0)
        return
    by_name: dict[str, list] = {}
    for pc in local_pieces(model):
        if pc.primary:
            by_name.setdefault(pc.name, []).append(pc)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))

    for name in sorted(by_name):
        pcs = by_name[name]
        if len(pcs) == 1 and tuple(pcs[0].data.shape) == tuple(pcs[0].full_shape):
            full = pcs[0].data
        elif (whole := _whole_param(pcs, params)) is not None:
            full = whole.detach()
        else:
            full = torch.empty(pcs[0].full_shape, dtype=pcs[0].data.dtype)
            count = torch.zeros(pcs[0].full_shape, dtype=torch.int8)
            for pc in pcs:
                full[pc.index()] = pc.data
                count[pc.index()] += 1
            if not bool((count == 1).all()):
                raise ValueError(f"{name}: local shards cover the full tensor {int(count.min())}.."
                                 f"{int(count.max())} times")
        if name in VOCAB_PARAMS and full.shape[0] > vocab_size:
            full = full[:vocab_size]
        yield name, full.to("cpu")


@_cpu_tensors_only
def _write_hf(full: Iterator[tuple[str, Tensor]], fam, hf_cfg: dict, dtype: str, hf_config_dir: str, out_dir: str,
              max_shard_size: str | int, fsync: bool, progress: bool) -> tuple[list[str], int]:
    """Rank 0 of :func:`megatron_to_hf_checkpoint`: the full Megatron tensors ``full`` mapped to
    HF names and written as sharded safetensors (+ index, + the side files of
    ``hf_config_dir``) into ``out_dir`` (FileExistsError if it is not empty). Returns (file
    names, tensor bytes)."""
    from tqdm import tqdm

    check_out_dir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    w = ShardWriter(out_dir, parse_size(max_shard_size), fsync=fsync)
    n_hf = len(fam.hf_keys(hf_cfg))
    out_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    with tqdm(total=n_hf, desc="Megatron->HF", unit="tensor", disable=not progress, leave=False) as bar:
        for name, t in fam.megatron_to_hf(full, hf_cfg):
            # Megatron keeps some params in fp32 in a bf16 model (the torch norms): back to the
            # checkpoint dtype (they were loaded from it: lossless)
            if t.dtype != out_dtype and not name.endswith(FP32_ANYWAY):
                t = t.to(out_dtype)
            w.add(name, t)
            bar.update(1)
    written = w.close()
    for fn in HF_SIDE_FILES:
        p = os.path.join(hf_config_dir, fn)
        if os.path.exists(p):
            shutil.copy(p, os.path.join(out_dir, fn))
    return written, w.total


def megatron_to_hf_checkpoint(megatron_dir: str, hf_config_dir: str, out_dir: str,
                              max_shard_size: str | int = "5GB", tp: int = 1, pp: int = 1, ep: int = 1,
                              progress: bool = True, vocab_div: int | None = None,
                              fsync: bool = False) -> dict[str, Any]:
    """Megatron torch_dist checkpoint (any saved layout) -> HF checkpoint dir, loaded at
    layout (tp, pp, ep) in the current torchrun world (1 process otherwise). The HF config
    (and tokenizer files) come from ``hf_config_dir``; it must be the config the checkpoint
    was converted from (``hf_config.json`` in the checkpoint is compared when present:
    ValueError naming the first differing field; a corrupt ``hf_config.json`` or
    ``moe_async_convert.json`` is a ValueError naming the file). The layout is checked by
    :func:`check_layout` first. ``fsync``: fsync each written safetensors file. Returns stats
    on every rank (``seconds``, ``phases``, ``files``, ``bytes_written``, ``world``)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing  # noqa: F401 - imported before the clock starts

    clock = _Clock()
    hf_cfg = read_hf_config(hf_config_dir)
    fam = get_family(hf_cfg.get("model_type"))
    arch_now = fam.arch_args(hf_cfg)
    check_layout(hf_cfg, tp, pp, ep)
    check_out_dir(out_dir)
    if not os.path.isdir(megatron_dir):
        raise FileNotFoundError(f"Megatron checkpoint dir {megatron_dir} does not exist")
    megatron_dir = container.resolve(megatron_dir)  # a Megatron-LM container root -> its iteration dir
    saved_cfg_p = os.path.join(megatron_dir, "hf_config.json")
    if os.path.exists(saved_cfg_p):
        saved = _json_object(saved_cfg_p, "the HF config this checkpoint was converted from")
        arch_saved = get_family(saved.get("model_type")).arch_args(saved)
        if arch_saved != arch_now:
            diff = [k for k in arch_now.__dataclass_fields__ if getattr(arch_saved, k) != getattr(arch_now, k)]
            raise ValueError(f"--hf-config does not match the checkpoint's HF config: field {diff[0]} "
                             f"({getattr(arch_now, diff[0])!r} vs saved {getattr(arch_saved, diff[0])!r})")
    meta_p = os.path.join(megatron_dir, META_NAME)
    meta = _json_object(meta_p, "conversion metadata") if os.path.exists(meta_p) else {}
    if vocab_div is None:
        vocab_div = int(meta.get("vocab_div", DEFAULT_VOCAB_DIV))
    ckpt_md = read_torch_dist_metadata(megatron_dir)
    dtype = _checkpoint_dtype(megatron_dir, meta, ckpt_md)
    # the padded vocab rows are part of the saved global shape: load with the same rows (the
    # padding rule of another TP could give a different count), which must split over TP
    rows = saved_vocab_rows(megatron_dir, ckpt_md)
    if rows is not None and rows % tp:
        raise ValueError(f"the checkpoint's padded vocab ({rows} rows) does not split over tp={tp}")
    written: list[str] = []
    nbytes = 0
    clock.mark("checks_s")
    with parallel_layout(tp, pp, ep):
        clock.mark("setup_s")
        model, vocab = build_model(hf_cfg, tp, pp, ep, params_dtype=dtype, vocab_div=vocab_div,
                                   padded_vocab=rows)
        clock.mark("build_s")
        load_megatron_into_model(model, megatron_dir, ckpt_md)
        clock.mark("torch_dist_load_s")
        full = _full_state(model, vocab)
        if _rank() == 0:
            written, nbytes = _write_hf(full, fam, hf_cfg, dtype, hf_config_dir, out_dir, max_shard_size, fsync,
                                        progress)
        else:
            for _ in full:  # collective: take part in the gather
                pass
        clock.mark("gather_map_write_s")
        dist.barrier()
        world = _world()
        clock.mark("finish_s")
        del model, full
        clock.mark("free_s")
    clock.mark("teardown_s")
    return {"seconds": clock.total(), "phases": clock.phases, "files": written, "bytes_written": nbytes,
            "world": world}


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


def run_tool(main, prog: str, argv: list[str] | None = None) -> int:
    """Run a converter's ``main(argv)`` with a refused input (bad layout, config, keys, files)
    reported as one ``<prog>: error: ...`` line on stderr and exit status 2 instead of a
    traceback; other exceptions propagate with theirs."""
    import sys

    try:
        return main(argv)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2

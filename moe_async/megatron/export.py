"""HF tensors out of Megatron model chunks, and the sharded safetensors writer.

- :func:`full_hf_state`: full (unsharded) Megatron tensors to rank 0
  (``sharding.gather_full_state``; copy-free views at world size 1), in the mapping table's order.
- :func:`write_hf`: HF tensors (:class:`moe_async.megatron.hf_export.HFExporter`) -> :class:`ShardWriter`
  (safetensors files of at most ``max_shard_size`` bytes + ``model.safetensors.index.json``),
  side files (:data:`HF_SIDE_FILES`) copied from the reference HF dir.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Iterator

import torch

from moe_async.megatron.hf_io import FP32_ANYWAY, INDEX_NAME, whole_param
from moe_async.megatron.parallel import cpu_tensors_only, world_size
from moe_async.megatron.tool_args import check_out_dir, parse_size

Tensor = torch.Tensor
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


def full_hf_state(model, vocab_size: int) -> Iterator[tuple[str, Tensor]]:
    """:func:`moe_async.megatron.sharding.gather_full_state` to rank 0, with a copy-free path
    at world size 1: a tensor held whole by one local piece is yielded as that piece (a view
    of the parameter, vocab padding sliced off) instead of being copied into a new buffer;
    tensors made of several local pieces are assembled, each element exactly once
    (ValueError otherwise). Same names, order and values as ``gather_full_state``."""
    from moe_async.megatron.sharding import VOCAB_PARAMS, gather_full_state, local_pieces

    if world_size() > 1:
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
        elif (whole := whole_param(pcs, params)) is not None:
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


@cpu_tensors_only
def write_hf(hf: Iterator[tuple[str, Tensor]], fam, hf_cfg: dict, dtype: str, hf_config_dir: str, out_dir: str,
              max_shard_size: str | int, fsync: bool, progress: bool) -> tuple[list[str], int]:
    """Rank 0 of :func:`megatron_to_hf_checkpoint`: the HF tensors ``hf`` (e.g.
    :meth:`moe_async.megatron.hf_export.HFExporter.hf_tensors`) written as sharded safetensors
    (+ index, + the side files of ``hf_config_dir``) into ``out_dir`` (FileExistsError if it
    is not empty). Returns (file names, tensor bytes)."""
    from tqdm import tqdm

    check_out_dir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    w = ShardWriter(out_dir, parse_size(max_shard_size), fsync=fsync)
    n_hf = len(fam.hf_keys(hf_cfg))
    out_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    with tqdm(total=n_hf, desc="Megatron->HF", unit="tensor", disable=not progress, leave=False) as bar:
        for name, t in hf:
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


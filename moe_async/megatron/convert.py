"""Checkpoint conversion HF safetensors <-> Megatron ``torch_dist``, at any TP/PP/EP layout.

The converters' library (``tools/convert_*.py``): the family's mapping table and the trainer's
sharding helpers, the same path as the trainer's HF load and export. A layout the model cannot
take, an unparsable JSON input, an unused HF key or a missing tensor is refused naming it before
anything is written; the CLIs print one ``error:`` line and exit 2
(:func:`moe_async.megatron.tool_args.run_tool`).

Design notes: ``docs/design/megatron.md``."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from moe_async.megatron import container
from moe_async.megatron.build import DEFAULT_VOCAB_DIV, build_model
from moe_async.megatron.dist_ckpt import load_megatron_into_model, save_strategy, whole_glu_tensors
from moe_async.megatron.dist_ckpt_files import checkpoint_dtype, read_torch_dist_metadata, saved_vocab_rows
from moe_async.megatron.export import write_hf
from moe_async.megatron.hf_export import HFExporter
from moe_async.megatron.hf_io import (
    check_hf_keys,
    hf_checkpoint_dtype,
    load_hf_into_model,
    read_hf_config,
    read_hf_index,
    read_json_dict,
)
from moe_async.megatron.parallel import check_layout, global_rank, parallel_layout, world_size
from moe_async.megatron.te_spec_names import add_te_extra_state, to_te_names
from moe_async.megatron.tool_args import check_out_dir
from moe_async.models import get_family
from moe_async.models.deepseek_v3.hf_extras import hf_extras

META_NAME = "moe_async_convert.json"


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


def _padded_vocab(vocab: int, tp: int, vocab_div: int) -> int:
    from moe_async.megatron.sharding import padded_vocab_size

    return padded_vocab_size(vocab, tp, vocab_div)


def hf_to_megatron_checkpoint(hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1, ep: int = 1,
                              progress: bool = True, vocab_div: int = DEFAULT_VOCAB_DIV,
                              save_threads: int = 0, fsync: bool = False, first: int | None = None,
                              last: int | None = None) -> dict[str, Any]:
    """HF checkpoint dir -> Megatron torch_dist checkpoint at layout (tp, pp, ep) (the
    world is the torchrun world, 1 process otherwise; DP = world / (tp*pp)), in Megatron-LM's
    container (``out_dir/latest_checkpointed_iteration.txt`` = 0, the torch_dist files in
    ``out_dir/iter_0000000/``, ``common.pt`` with ``iteration`` and ``args``:
    :mod:`moe_async.megatron.container`) under the Transformer Engine spec's key names
    (:mod:`moe_async.megatron.te_spec_names`); a DeepSeek-V3 release's MTP keys are skipped
    (logged) and its FP8 weights dequantized (:mod:`moe_async.models.deepseek_v3.hf_extras`); written by
    :func:`save_strategy` ``(save_threads, fsync)`` (default: in the calling process, no
    fsync). ``first`` / ``last``: layers on the first / last PP stage (uneven stages; recorded
    in ``moe_async_convert.json`` and in Megatron-LM's ``decoder_first/last_pipeline_num_layers``
    args). The layout (:func:`check_layout`), the HF config (family spec) and the HF keys
    are checked before any process group, model or file exists. Returns stats on every
    rank: ``seconds``, ``phases`` (seconds per step), ``bytes_read`` (summed over ranks),
    ``hf_bytes``, ``world``."""
    clock = _Clock()
    hf_cfg = read_hf_config(hf_dir)
    fam = get_family(hf_cfg.get("model_type"))
    a = fam.arch_args(hf_cfg)  # refuses an unsupported config, naming the field
    check_out_dir(out_dir)  # the checks without Megatron (imported by check_layout) first
    index = read_hf_index(hf_dir)
    check_layout(hf_cfg, tp, pp, ep, first=first, last=last)
    extras = hf_extras(hf_cfg, index)  # DeepSeek-V3: MTP keys skipped (logged), FP8 weights + scales
    check_hf_keys(fam, a, extras.weights(index))  # refuse unused / missing keys before building anything
    dtype = hf_checkpoint_dtype(hf_cfg, extras.plain(index))
    hf_bytes = sum(os.path.getsize(p) for p in set(index.values()))
    clock.mark("checks_s")
    import torch.distributed as dist  # after the checks: a refused output dir or file costs no Megatron import
    from megatron.core import dist_checkpointing

    clock.mark("import_s")
    with parallel_layout(tp, pp, ep):
        clock.mark("setup_s")
        model, vocab = build_model(hf_cfg, tp, pp, ep, params_dtype=dtype, vocab_div=vocab_div, first=first,
                                   last=last)
        clock.mark("build_s")
        stats = load_hf_into_model(model, hf_cfg, index, vocab, progress=progress and global_rank() == 0)
        clock.mark("read_map_copy_s")
        root, out_dir = out_dir, container.iteration_dir(out_dir, 0)  # Megatron-LM's container
        if global_rank() == 0:
            check_out_dir(root)
            os.makedirs(out_dir, exist_ok=True)
        dist.barrier()
        sd = model.sharded_state_dict()
        to_te_names(sd)  # the TE spec's key names on any machine
        add_te_extra_state(sd)  # and the TE modules' _extra_state objects (strict TE-spec loads)
        whole_glu_tensors(sd)
        common = container.common_state(0, container.megatron_lm_args(
            a, tp=tp, pp=pp, ep=ep, padded_vocab_size=_padded_vocab(vocab, tp, vocab_div), vocab_div=vocab_div,
            params_dtype=dtype, world=world_size(), iteration=0,
            extra={**container.family_config_args(fam, a), "decoder_first_pipeline_num_layers": first,
                   "decoder_last_pipeline_num_layers": last}))
        dist_checkpointing.save({"model": sd, **common}, out_dir, sharded_strategy=save_strategy(save_threads, fsync))
        clock.mark("torch_dist_save_s")
        t = torch.tensor([float(stats["bytes_read"])], dtype=torch.float64)
        dist.all_reduce(t)
        if global_rank() == 0:
            meta = {
                "format": "moe_async megatron torch_dist (model only)",
                "model_type": hf_cfg["model_type"],
                "vocab_size": vocab,
                "params_dtype": dtype,
                "vocab_div": vocab_div,
                "saved_layout": {"tp": tp, "pp": pp, "ep": ep, "world": world_size(),
                                 "num_layers_in_first_pipeline_stage": first,
                                 "num_layers_in_last_pipeline_stage": last},
            }
            for name, obj in (("hf_config.json", hf_cfg), (META_NAME, meta)):
                with open(os.path.join(out_dir, name), "w") as f:
                    json.dump(obj, f, indent=2, sort_keys=True)
                    if fsync:
                        f.flush()
                        os.fsync(f.fileno())
            container.write_tracker(root, 0, fsync)  # last: the iteration dir is complete
        dist.barrier()
        world = world_size()
        clock.mark("finish_s")
        del model, sd
        clock.mark("free_s")
    clock.mark("teardown_s")
    return {"seconds": clock.total(), "phases": clock.phases, "bytes_read": float(t.item()), "hf_bytes": hf_bytes,
            "world": world, "megatron_lm_args": container.megatron_lm_load_command(root)}


def megatron_to_hf_checkpoint(megatron_dir: str, hf_config_dir: str, out_dir: str,
                              max_shard_size: str | int = "5GB", tp: int = 1, pp: int = 1, ep: int = 1,
                              progress: bool = True, vocab_div: int | None = None,
                              fsync: bool = False, first: int | None = None,
                              last: int | None = None) -> dict[str, Any]:
    """Megatron torch_dist checkpoint (any saved layout, uneven PP stages included) -> HF
    checkpoint dir, loaded at layout (tp, pp, ep) in the current torchrun world (1 process
    otherwise), with ``first`` / ``last`` layers on the first / last PP stage when set. The HF config
    (and tokenizer files) come from ``hf_config_dir``; it must be the config the checkpoint
    was converted from (``hf_config.json`` in the checkpoint is compared when present:
    ValueError naming the first differing field; a corrupt ``hf_config.json`` or
    ``moe_async_convert.json`` is a ValueError naming the file). The layout is checked by
    :func:`check_layout` first. ``fsync``: fsync each written safetensors file. Returns stats
    on every rank (``seconds``, ``phases``, ``files``, ``bytes_written``, ``world``)."""
    clock = _Clock()
    hf_cfg = read_hf_config(hf_config_dir)
    fam = get_family(hf_cfg.get("model_type"))
    arch_now = fam.arch_args(hf_cfg)
    check_out_dir(out_dir)  # the checks without Megatron (imported by check_layout) first
    if not os.path.isdir(megatron_dir):
        raise FileNotFoundError(f"Megatron checkpoint dir {megatron_dir} "
                                + ("is a file, not a directory" if os.path.exists(megatron_dir) else "does not exist"))
    check_layout(hf_cfg, tp, pp, ep, first=first, last=last)
    megatron_dir = container.resolve(megatron_dir)  # a Megatron-LM container root -> its iteration dir
    saved_cfg_p = os.path.join(megatron_dir, "hf_config.json")
    if os.path.exists(saved_cfg_p):
        saved = read_json_dict(saved_cfg_p, "the HF config this checkpoint was converted from")
        arch_saved = get_family(saved.get("model_type")).arch_args(saved)
        if arch_saved != arch_now:
            diff = [k for k in arch_now.__dataclass_fields__ if getattr(arch_saved, k) != getattr(arch_now, k)]
            raise ValueError(f"--hf-config does not match the checkpoint's HF config: field {diff[0]} "
                             f"({getattr(arch_now, diff[0])!r} vs saved {getattr(arch_saved, diff[0])!r})")
    meta_p = os.path.join(megatron_dir, META_NAME)
    meta = read_json_dict(meta_p, "conversion metadata") if os.path.exists(meta_p) else {}
    if vocab_div is None:
        vocab_div = int(meta.get("vocab_div", DEFAULT_VOCAB_DIV))
    ckpt_md = read_torch_dist_metadata(megatron_dir)
    dtype = checkpoint_dtype(megatron_dir, meta, ckpt_md)
    # the padded vocab rows are part of the saved global shape: load with the same rows (the
    # padding rule of another TP could give a different count), which must split over TP
    rows = saved_vocab_rows(megatron_dir, ckpt_md)
    if rows is not None and rows % tp:
        raise ValueError(f"the checkpoint's padded vocab ({rows} rows) does not split over tp={tp}")
    written: list[str] = []
    nbytes = 0
    clock.mark("checks_s")
    import torch.distributed as dist  # after the checks: a refused output dir or file costs no Megatron import
    from megatron.core import dist_checkpointing  # noqa: F401 - its import timed apart (import_s)

    clock.mark("import_s")
    with parallel_layout(tp, pp, ep):
        clock.mark("setup_s")
        model, vocab = build_model(hf_cfg, tp, pp, ep, params_dtype=dtype, vocab_div=vocab_div,
                                   padded_vocab=rows, first=first, last=last)
        clock.mark("build_s")
        load_megatron_into_model(model, megatron_dir, ckpt_md)
        clock.mark("torch_dist_load_s")
        hf = HFExporter([model], fam, hf_cfg, vocab).hf_tensors()  # collective; rank 0 yields
        if global_rank() == 0:
            written, nbytes = write_hf(hf, fam, hf_cfg, dtype, hf_config_dir, out_dir, max_shard_size, fsync,
                                        progress)
        else:
            for _ in hf:  # collective: take part in the gather
                pass
        clock.mark("gather_map_write_s")
        dist.barrier()
        world = world_size()
        clock.mark("finish_s")
        del model, hf
        clock.mark("free_s")
    clock.mark("teardown_s")
    return {"seconds": clock.total(), "phases": clock.phases, "files": written, "bytes_written": nbytes,
            "world": world}

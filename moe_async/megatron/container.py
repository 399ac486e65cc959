"""Megatron-LM's checkpoint container around a torch_dist checkpoint.

Writes and reads Megatron-LM's layout (``latest_checkpointed_iteration.txt``, ``iter_<N:07d>/``,
``common.pt`` with ``iteration``, ``checkpoint_version`` and ``args``), so a converted or trained
checkpoint loads with Megatron-LM's ``--load`` and this project loads Megatron-LM's. A model
without its HF config never silently trains from random weights.

Design notes: ``docs/design/megatron.md``."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Mapping

from moe_async.models.family import ArchArgs, ModelFamily
from moe_async.models.deepseek_v3 import DeepseekV3Args

TRACKER_NAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0

#: The Megatron-LM arguments (besides ``--load ROOT --ckpt-format torch_dist`` and the model's own)
#: that its ``load_checkpoint`` needs to resume a checkpoint of this project: neither the
#: converter's (model only) nor the trainer's hold Megatron-LM's ``opt_param_scheduler`` (the
#: trainer's LR is a function of the iteration, with no OptimizerParamScheduler state) or its
#: ``rng_state`` object (the trainer keeps its RNG states in ``moe_async_rng/``), and without
#: these flags Megatron-LM exits with "Unable to load optimizer / rng state from checkpoint".
#: The weights, the iteration and the args load as saved; ``--finetune`` instead also restarts
#: the iteration count at 0.
MEGATRON_LM_LOAD_FLAGS = ("--no-load-optim", "--no-load-rng")


def megatron_lm_load_command(root: str) -> str:
    """The Megatron-LM arguments that load the checkpoint root ``root`` (tracker + iteration
    dirs): ``--load ROOT --ckpt-format torch_dist`` and :data:`MEGATRON_LM_LOAD_FLAGS`."""
    return " ".join(["--load", root, "--ckpt-format", "torch_dist", *MEGATRON_LM_LOAD_FLAGS])


def iteration_dir(root: str, iteration: int | str) -> str:
    """``<root>/iter_<iteration:07d>`` (``<root>/release`` for ``"release"``)."""
    if iteration == "release":
        return os.path.join(root, "release")
    return os.path.join(root, f"iter_{int(iteration):07d}")


def read_tracker(root: str) -> int | str | None:
    """The iteration ``<root>/latest_checkpointed_iteration.txt`` names (int, or
    ``"release"``); None when there is no tracker. ValueError naming the file when its text
    is neither a non-negative integer nor ``release``."""
    p = os.path.join(root, TRACKER_NAME)
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        text = f.read().strip()
    if text == "release":
        return text
    if not text.isdigit():
        raise ValueError(f"{p} (Megatron-LM checkpoint tracker) holds {text[:40]!r}, not an iteration number "
                         "or 'release'")
    return int(text)


def resolve(path: str) -> str:
    """The torch_dist directory of a checkpoint ``path``: the iteration directory its tracker
    names when ``path`` is a Megatron-LM container root, else ``path`` itself (an iteration
    directory, or an old flat checkpoint directory). FileNotFoundError naming the tracker
    when the directory it names is absent; ValueError for a malformed tracker."""
    if not os.path.isdir(path):
        return path
    it = read_tracker(path)
    if it is None:
        return path
    d = iteration_dir(path, it)
    if not os.path.isdir(d):
        what = "is a file, not a directory" if os.path.exists(d) else "does not exist"
        raise FileNotFoundError(f"{os.path.join(path, TRACKER_NAME)} names iteration {it}, but {d} {what}")
    return d


def write_tracker(root: str, iteration: int | str, fsync: bool = False) -> None:
    """Write ``<root>/latest_checkpointed_iteration.txt`` (through a temporary file and an
    atomic rename: a reader sees the old or the new iteration, never a partial file)."""
    p = os.path.join(root, TRACKER_NAME)
    tmp = p + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, p)


# Megatron-LM's defaults of the arguments Megatron-Bridge's MLM-compat loader reads directly
# (``megatron/bridge/training/mlm_compat/arguments.py`` ``_transformer_config_from_args``, used by
# ``load_megatron_model`` on an iteration dir without Bridge's run_config.yaml)
_MLM_DEFAULTS: dict[str, object] = dict(
    heterogeneous_layers_config_path=None, no_persist_layer_norm=False, apply_layernorm_1p=False,
    overlap_p2p_comm=False, rotary_interleaved=False, decoder_first_pipeline_num_layers=None,
    decoder_last_pipeline_num_layers=None, fp8_param_gather=False, bias_swiglu_fusion=True,
    bias_gelu_fusion=False, squared_relu=False, init_method_xavier_uniform=False, config_logger_dir="",
    cp_comm_type=["p2p"], is_hybrid_model=False, multi_latent_attention=False, num_experts=None,
    # and its GPT provider (mlm_compat/model.py, _gpt_provider)
    qk_layernorm=False, qk_l2_norm=False, moe_grouped_gemm=False, mtp_num_layers=None, fp16_lm_cross_entropy=False,
    rotary_percent=1.0, use_rope_scaling=False, init_model_with_meta_device=False,
)


def megatron_lm_args(arch: ArchArgs, *, tp: int, pp: int, ep: int, padded_vocab_size: int, vocab_div: int,
                     params_dtype: str, world: int, iteration: int, extra: Mapping[str, object] | None = None,
                     ) -> argparse.Namespace:
    """Megatron-LM's ``args`` of a model of architecture ``arch`` (:class:`ArchArgs`, or a
    family subclass: MLA and MoE fields are added when present) saved at layout (tp, pp, ep)
    in a world of ``world`` processes; ``params_dtype`` "fp32" / "bf16"; ``extra``: more
    fields (e.g. the family's ``TransformerConfig`` keyword arguments, whose names are
    Megatron-LM's argument names). Argument names are Megatron-LM's
    (``megatron/training/arguments.py``)."""
    import torch

    d: dict[str, object] = dict(_MLM_DEFAULTS)
    d.update(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads, group_query_attention=arch.num_key_value_heads
        != arch.num_attention_heads, num_query_groups=arch.num_key_value_heads, kv_channels=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings, seq_length=arch.max_position_embeddings,
        position_embedding_type="rope", add_position_embedding=False, rotary_base=arch.rope_theta,
        normalization="RMSNorm", norm_epsilon=arch.rms_norm_eps, swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=not arch.tie_word_embeddings,
        padded_vocab_size=padded_vocab_size, make_vocab_size_divisible_by=vocab_div,
        tokenizer_type="HuggingFaceTokenizer", vocab_file=None,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        data_parallel_size=world // (tp * pp), world_size=world,
        bf16=params_dtype == "bf16", fp16=False, ckpt_format="torch_dist", use_dist_ckpt=True,
        transformer_impl="transformer_engine", iteration=iteration, consumed_train_samples=0,
        consumed_valid_samples=0, train_iters=None, hf_model_type=arch.model_type,
        params_dtype=torch.bfloat16 if params_dtype == "bf16" else torch.float32,
    )
    if arch.num_experts:
        d.update(num_experts=arch.num_experts, moe_router_topk=arch.top_k,
                 moe_ffn_hidden_size=arch.intermediate_size, moe_grouped_gemm=False)
    if isinstance(arch, DeepseekV3Args) and arch.kv_lora_rank:
        d.update(multi_latent_attention=True, q_lora_rank=arch.q_lora_rank, kv_lora_rank=arch.kv_lora_rank,
                 qk_head_dim=arch.qk_nope_head_dim, qk_pos_emb_head_dim=arch.qk_rope_head_dim,
                 v_head_dim=arch.v_head_dim)
    d.update(extra or {})
    if d.get("num_moe_experts") and not d.get("num_experts"):
        d["num_experts"] = d["num_moe_experts"]  # Megatron-LM's name of TransformerConfig.num_moe_experts
    return argparse.Namespace(**d)


def family_config_args(family: ModelFamily, arch: ArchArgs) -> dict[str, object]:
    """The family's ``TransformerConfig`` keyword arguments (MoE router, MLA, qk norm, ...) as
    Megatron-LM arguments (the same names), callables and the aux-loss coefficient left out."""
    kw = family.model_config_kwargs(arch, moe_aux_loss_coeff=0.0)
    return {k: v for k, v in kw.items() if not callable(v) and k != "moe_aux_loss_coeff"}


def common_state(iteration: int, args: argparse.Namespace) -> dict[str, object]:
    """The non-tensor items Megatron-LM puts beside ``model`` in the saved state dict (they
    land in ``common.pt``): ``args``, ``checkpoint_version``, ``iteration``."""
    return {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": int(iteration)}


def read_common(ckpt_dir: str) -> dict[str, Any]:
    """``common.pt`` of a torch_dist directory (``torch.load``, as Megatron's
    ``load_common``). Errors are torch's, the caller names the file."""
    import torch

    return torch.load(os.path.join(ckpt_dir, "common.pt"), map_location="cpu", weights_only=False)


def trainer_common_state(trainer: Any) -> dict[str, object]:  # a MegatronTrainer (a later layer)
    """:func:`common_state` of a ``MegatronTrainer`` (iteration = its ``version``, the
    optimizer steps taken; args from its HF config, trainer config and world layout)."""
    import torch.distributed as dist

    from moe_async.megatron.sharding import padded_vocab_size

    c = trainer.cfg
    tp, pp, ep = c.tensor_model_parallel_size, c.pipeline_model_parallel_size, c.expert_model_parallel_size
    world = dist.get_world_size() if dist.is_initialized() else 1
    args = megatron_lm_args(
        trainer.family.arch_args(trainer.hf_config), tp=tp, pp=pp, ep=ep,
        padded_vocab_size=padded_vocab_size(trainer.vocab_size, tp, c.make_vocab_size_divisible_by),
        vocab_div=c.make_vocab_size_divisible_by, params_dtype=c.params_dtype, world=world,
        iteration=trainer.version,
        extra={**family_config_args(trainer.family, trainer.family.arch_args(trainer.hf_config)),
               "expert_tensor_parallel_size": getattr(c, "expert_tensor_parallel_size", None) or 1,
               "context_parallel_size": getattr(c, "context_parallel_size", 1) or 1,
               "virtual_pipeline_model_parallel_size": c.virtual_pipeline_model_parallel_size,
               "micro_batch_size": c.micro_batch_size, "lr": c.lr,
               # uneven pipeline stages and the expert MLP layout, under Megatron-LM's names
               "decoder_first_pipeline_num_layers": getattr(c, "num_layers_in_first_pipeline_stage", None),
               "decoder_last_pipeline_num_layers": getattr(c, "num_layers_in_last_pipeline_stage", None),
               **({"moe_grouped_gemm": True} if getattr(c, "moe_grouped_gemm", False) else {})})
    return common_state(trainer.version, args)


def link_iteration(root: str, ckpt_name: str, iteration: int) -> None:
    """Make the checkpoint directory ``<root>/<ckpt_name>`` (e.g. the driver's ``step_<N>``)
    findable by Megatron-LM's ``--load <root>``: a relative symlink ``<root>/iter_<N:07d>``
    -> ``<ckpt_name>`` (replaced atomically), then the tracker (:func:`write_tracker`); logs
    (INFO) the Megatron-LM arguments that resume it (:func:`megatron_lm_load_command`)."""
    link = iteration_dir(root, iteration)
    tmp = link + ".tmp"
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(ckpt_name, tmp)
    os.replace(tmp, link)
    write_tracker(root, iteration)
    logging.getLogger(__name__).info("checkpoint %s: Megatron-LM resumes it with %s", link,
                                     megatron_lm_load_command(root))

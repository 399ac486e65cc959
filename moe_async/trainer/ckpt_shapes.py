"""Does a torch_dist checkpoint hold the configured model? Answered from metadata alone, before
any process starts (``trainer.load`` pointing at another model's checkpoint).

The configured model's expected global keys and shapes (HF config on the ``meta`` device, the
family's mapping, Megatron's stacked-layer names under either layer spec) are compared with the
checkpoint's metadata; the first tensor that differs is named.

Design notes: ``docs/design/trainer.md``."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Mapping

from moe_async.errors import UserInputError

if TYPE_CHECKING:
    from moe_async.trainer.config import TrainerConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
# local-spec norm names -> the names Megatron-Core's sharded_state_dict stores them under
_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
          "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def megatron_shapes(hf_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Megatron per-layer parameter names and shapes (local spec, unpadded vocab) of the model
    ``hf_config`` describes, in the family mapping's order, without building it.

    Raises: ValueError (unsupported model_type or field), KeyError (missing field)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from moe_async.models import get_family

    d = dict(hf_config)
    fam = get_family(d.get("model_type"))
    fam.arch_args(d)  # the family's own checks first, with their messages
    cfg = AutoConfig.for_model(**d)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    sd = dict(model.state_dict())
    if d.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)  # tied: the embedding (hf_to_megatron would compare values)
    return {k: tuple(v.shape) for k, v in fam.hf_to_megatron(sd, d).items()}


def torch_dist_shapes(per_layer: Mapping[str, tuple[int, ...]], vocab_rows: int | None = None,
                      ) -> dict[str, tuple[int, ...]]:
    """The global torch_dist keys and shapes of ``per_layer`` (:func:`megatron_shapes`), see the
    ``docs/design/trainer.md``; ``vocab_rows``: Megatron's padded vocab (None: as given)."""
    out: dict[str, tuple[int, ...]] = {}  # insertion order: the mapping's
    inner: dict[str, tuple[int, ...]] = {}  # key -> the shape of one layer's (one expert's) tensor
    layers: dict[str, set[int]] = {}  # key -> layer indices
    experts: dict[str, set[int]] = {}  # expert key -> expert indices
    for name, shape in per_layer.items():
        m = _LAYER.match(name)
        if not m:
            if vocab_rows is not None and name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                shape = (vocab_rows, *shape[1:])
            out[name] = tuple(shape)
            continue
        i, rest = int(m.group(1)), m.group(2)
        e = _EXPERT.match(rest)
        tail = f"mlp.experts.experts.{e.group(2)}" if e else None
        for key in (f"decoder.layers.{i}." + (tail or rest),  # per layer
                    "decoder.layers." + (tail or _NORMS.get(rest, rest))):  # stacked over layers
            out.setdefault(key, ())
            inner.setdefault(key, tuple(shape))
            layers.setdefault(key, set()).add(i)
            if e:
                experts.setdefault(key, set()).add(int(e.group(1)))
    n_layers = 1 + max((i for ls in layers.values() for i in ls), default=-1)
    for key, shape in inner.items():
        stacked = not _LAYER.match(key)
        lead = ((n_layers,) if stacked else ()) + ((len(experts[key]),) if key in experts else ())
        out[key] = (*lead, *shape)
    # the Transformer Engine spec's names, as the checkpoints have them (te_spec_names.py)
    from moe_async.megatron.te_spec_names import layer_kinds, te_name

    kinds = layer_kinds(out)
    return {te_name(k, kinds): v for k, v in out.items()}


def first_shape_difference(saved: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]],
                           ) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """``(key, saved shape, expected shape)`` of the first key of ``expected`` (in its order)
    that ``saved`` holds with another shape; None when every shared key agrees."""
    for k, want in expected.items():
        got = saved.get(k)
        if got is not None and tuple(got) != tuple(want):
            return k, tuple(got), tuple(want)
    return None


def saved_tensor_shapes(ckpt_dir: str) -> dict[str, tuple[int, ...]]:
    """Global shapes of the model tensors (not optimizer state) in a torch_dist checkpoint's
    ``.metadata``; the model keys as saved (a ``model.`` / ``model<v>.`` prefix, if any, dropped).

    Raises: FileNotFoundError / ValueError naming the file (:func:`read_torch_dist_metadata`)."""
    from moe_async.megatron.container import resolve
    from moe_async.megatron.dist_ckpt_files import is_optimizer_key, read_torch_dist_metadata

    md = read_torch_dist_metadata(resolve(ckpt_dir)).state_dict_metadata
    out = {}
    for k, v in md.items():
        if is_optimizer_key(k) or not hasattr(v, "size"):
            continue
        out[re.sub(r"^model\d*\.", "", k)] = tuple(v.size)
    return out


def check_checkpoint_matches_model(ckpt_dir: str, hf_config: Mapping[str, Any] | None, trainer_cfg: TrainerConfig,
                                   field: str = "trainer.load") -> None:
    """Refuse a checkpoint whose tensors have other shapes than the configured model's.

    ``hf_config``: the configured model's HF config (None: unknown yet, nothing is checked);
    ``trainer_cfg``: a ``TrainerConfig`` (TP and ``make_vocab_size_divisible_by`` give the
    padded vocab rows).

    Raises:
        UserInputError: naming ``field``, the checkpoint, the first tensor whose shape differs
            and both shapes; or naming the checkpoint's ``.metadata`` when it cannot be read.
    """
    if hf_config is None:
        return
    from moe_async.megatron.sharding import padded_vocab_size

    try:
        saved = saved_tensor_shapes(ckpt_dir)
    except (OSError, ValueError) as e:
        raise UserInputError(f"{field}={ckpt_dir!r}: {e}") from None
    rows = padded_vocab_size(int(hf_config["vocab_size"]), trainer_cfg.tensor_model_parallel_size,
                             trainer_cfg.make_vocab_size_divisible_by)
    expected = torch_dist_shapes(megatron_shapes(hf_config), rows)
    diff = first_shape_difference(saved, expected)
    if diff is None:
        return
    k, got, want = diff
    hint = (" (padded vocab rows: set trainer.make_vocab_size_divisible_by so that they agree)"
            if k in ("embedding.word_embeddings.weight", "output_layer.weight") and got[1:] == want[1:] else "")
    raise UserInputError(
        f"{field}={ckpt_dir!r} is a checkpoint of another model: tensor {k} has shape {list(got)} there, "
        f"the configured model ({hf_config.get('model_type')}) needs {list(want)}{hint}")


def check_load_matches_config(ckpt_dir: str, cfg: Any) -> None:
    """:func:`check_checkpoint_matches_model` for ``trainer.load`` = ``ckpt_dir`` (resolved) and
    the experiment config ``cfg``, the model's HF config from
    :func:`moe_async.models.prepare.configured_hf_config` (nothing is made or loaded). A
    checkpoint without a ``.metadata`` file is left to the trainer's load, which names it.

    Raises: UserInputError naming ``trainer.load`` and the first tensor whose shape differs."""
    import os

    if not os.path.isfile(os.path.join(ckpt_dir, ".metadata")):
        return
    from moe_async.models.prepare import configured_hf_config

    check_checkpoint_matches_model(ckpt_dir, configured_hf_config(cfg.model), cfg.trainer)

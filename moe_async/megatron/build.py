"""Megatron-Core model chunks from a model family, an HF config and the current parallel state.

:func:`model_chunks` is the one place a ``GPTModel`` is constructed (trainer and converters):
the family's layer spec (TE spec with CUDA + Transformer Engine, else the local spec), one
chunk per virtual pipeline stage (Megatron-LM's ``get_model``: chunk ``v`` holds the layers of
``get_transformer_layer_offset(config, vp_stage=v)``; the first stage's chunk 0 embeds, the
last stage's last chunk has the output layer), logits gathered over TP (``parallel_output=False``:
``[B, S, V_padded]`` on every TP rank). :func:`build_model` is the converters' one-chunk build
at TP/PP/EP with the vocab padded as the trainer pads it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable

from moe_async.megatron.parallel import have_te
from moe_async.compat.attention_spec import LayerSpec
from moe_async.models import get_family, hf_config_dict
from moe_async.models.family import GptModelKwargs, HfConfig, ModelFamily
from moe_async.types import JsonDict

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

# Megatron-Core's default make_vocab_size_divisible_by (Megatron-LM); only the stored shape
# depends on it, the HF tensors never (padding rows are zeros, dropped on export).
DEFAULT_VOCAB_DIV = 128


def model_chunks(family: ModelFamily, hf_config: JsonDict, tf_config: TransformerConfig, gpt_kwargs: GptModelKwargs, *,
                 vpp: int | None = None, wrap_spec: Callable[[LayerSpec], LayerSpec] = lambda spec: spec) -> list[GPTModel]:
    """This PP rank's ``GPTModel`` chunks at the current Megatron parallel state: one per
    virtual pipeline stage ``v`` in ``vp_stage`` order (one chunk with ``vpp`` None).

    Args:
        family: the model family (``layer_spec``); hf_config: its HF config dict.
        tf_config: the ``TransformerConfig``; gpt_kwargs: ``GPTModel`` keyword arguments
            (``vocab_size`` already padded).
        vpp: virtual pipeline stages per PP rank, or None.
        wrap_spec: applied to every layer spec before the build (the trainer's CPU CP/THD
            attention swap).

    Raises:
        NotImplementedError: ``vpp`` with a family whose ``layer_spec`` returns a decoder block
            spec without a ``vp_stage`` argument (its layers would be one stage's, not one chunk's).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    use_te = have_te()
    # a family whose spec is a decoder block spec (deepseek_v3: first-k dense layers) lists
    # one model chunk's layers and takes ``vp_stage``: one spec per chunk with virtual
    # pipeline stages; a per-layer spec (the other families) is the same for every chunk
    per_chunk_spec = bool(vpp) and "vp_stage" in inspect.signature(family.layer_spec).parameters
    layer_spec = None if per_chunk_spec else wrap_spec(family.layer_spec(hf_config, use_te=use_te))
    if vpp and isinstance(layer_spec, TransformerBlockSubmodules):  # one PP stage's layers
        raise NotImplementedError(
            f"trainer.virtual_pipeline_model_parallel_size={vpp} with model_type "
            f"{hf_config.get('model_type')!r}: the family's layer_spec returns a decoder block spec "
            "without a vp_stage argument (its layers would be one pipeline stage's, not one chunk's)")
    # a decoder-block family's layer_spec also takes vp_stage (per_chunk_spec above)
    chunk_spec: Callable[..., LayerSpec] = family.layer_spec
    chunks: list[GPTModel] = []
    for v in range(vpp or 1):
        stage = dict(ignore_virtual=False, vp_stage=v) if vpp else {}
        chunks.append(GPTModel(
            config=tf_config,
            transformer_layer_spec=(wrap_spec(chunk_spec(hf_config, use_te=use_te, vp_stage=v))
                                    if per_chunk_spec else layer_spec),
            pre_process=ps.is_pipeline_first_stage(**stage),
            post_process=ps.is_pipeline_last_stage(**stage),
            parallel_output=False,  # logits gathered over TP: [B,S,V_padded] on every TP rank
            vp_stage=v if vpp else None,
            **gpt_kwargs,
        ))
    return chunks


def build_model(hf_config: HfConfig, tp: int, pp: int, ep: int, *, params_dtype: str = "fp32",
                vocab_div: int = DEFAULT_VOCAB_DIV, padded_vocab: int | None = None,
                first: int | None = None, last: int | None = None, wrap_spec: Callable[[LayerSpec], LayerSpec] | None = None
                ) -> tuple[GPTModel, int]:
    """This rank's ``GPTModel`` stage for ``hf_config`` at the current Megatron parallel
    state, built by :func:`model_chunks` as the trainer builds it (same family helpers, vocab
    padded to a multiple of ``vocab_div * tp``, or to ``padded_vocab`` rows when given),
    without random init (every parameter is overwritten by the load); on the CUDA device
    when there is one. ``first`` / ``last``: layers on the first / last PP stage (uneven
    stages, Megatron-Core's ``num_layers_in_first/last_pipeline_stage``); ``wrap_spec``: as in
    :func:`model_chunks`. Returns ``(model, hf_vocab_size)``."""
    import torch

    from moe_async.megatron.sharding import padded_vocab_size

    d = hf_config_dict(hf_config)
    fam = get_family(d.get("model_type"))
    tf = fam.transformer_config(
        d,
        params_dtype=params_dtype,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        **{k: v for k, v in (("num_layers_in_first_pipeline_stage", first),
                             ("num_layers_in_last_pipeline_stage", last)) if v is not None},
    )
    # every parameter is overwritten by the load: allocate without the random init
    tf.perform_initialization = False
    kw = fam.gpt_model_kwargs(d)
    vocab = int(kw["vocab_size"])
    kw["vocab_size"] = padded_vocab if padded_vocab is not None else padded_vocab_size(vocab, tp, vocab_div)
    (model,) = model_chunks(fam, d, tf, kw, wrap_spec=wrap_spec) if wrap_spec else model_chunks(fam, d, tf, kw)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model, vocab


# the refusal where no grouped expert MLP can be built (here and at config check, trainer/moe_kernels.py)
GROUPED_GEMM_UNAVAILABLE = (
    "trainer.moe_grouped_gemm=true needs Transformer Engine (Megatron-Core's TEGroupedMLP) or the grouped_gemm "
    "package (its legacy GroupedMLP) on a CUDA host: neither is installed here; set trainer.moe_grouped_gemm=false "
    "(the sequential expert MLP, same checkpoints and HF export)")


def grouped_experts_spec(spec: LayerSpec) -> tuple[LayerSpec, int]:
    """A copy of the layer spec (or decoder block spec) ``spec`` whose routed experts are
    Megatron-Core's grouped expert MLP: ``TEGroupedMLP`` (from ``TESpecProvider.grouped_mlp_modules``,
    as ``get_gpt_layer_with_transformer_engine_spec(moe_grouped_gemm=True)`` builds it) where
    Transformer Engine's ``GroupedLinear`` exists, else the legacy ``GroupedMLP`` (as the local
    spec builds it), whose grouped GEMM is the ``grouped_gemm`` package's or, without CUDA, the
    compat stand-in (:mod:`moe_async.compat.grouped_gemm`); shared experts are left as they
    are. Returns ``(copy, number of MoE layers changed)``.

    Raises:
        ValueError: neither can run here (CUDA without Transformer Engine and without the
            ``grouped_gemm`` package), naming ``trainer.moe_grouped_gemm``.
    """
    import copy
    import warnings

    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.transformer.moe import grouped_gemm_util
    from megatron.core.transformer.moe.experts import GroupedMLP, TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from moe_async.compat import apply_cpu_compat

    with warnings.catch_warnings():  # its legacy-GroupedMLP deprecation warning: that case is handled below
        warnings.simplefilter("ignore")
        module, submodules = TESpecProvider().grouped_mlp_modules(True, False)
    if module is not TEGroupedMLP:
        apply_cpu_compat()  # without CUDA: the stand-in grouped GEMM (no-op with CUDA)
        if not grouped_gemm_util.grouped_gemm_is_available():
            raise ValueError(GROUPED_GEMM_UNAVAILABLE)
        module, submodules = GroupedMLP, None
    spec = copy.deepcopy(spec)
    n = 0
    seen: set[int] = set()

    def walk(x: Any) -> None:  # any object of a spec tree (Megatron's spec classes)
        nonlocal n
        if x is None or id(x) in seen or isinstance(x, (str, int, float, bool, type)):
            return
        seen.add(id(x))
        if isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
            return
        if isinstance(x, ModuleSpec) and x.module is MoELayer and getattr(x.submodules, "experts", None) is not None:
            old = x.submodules.experts
            act = getattr(getattr(old, "submodules", None), "activation_func", None)
            sub = copy.deepcopy(submodules)
            if sub is not None and act is not None:
                sub.activation_func = act
            x.submodules.experts = ModuleSpec(module=module, submodules=sub)
            n += 1
            return
        for name in ("submodules", "layer_specs", "mlp"):
            walk(getattr(x, name, None))

    walk(spec)
    return spec, n

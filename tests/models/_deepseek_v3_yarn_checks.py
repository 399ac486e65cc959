"""DeepSeek-V3 with the released YaRN ``rope_scaling`` (factor 40, mscale = mscale_all_dim = 1,
original 4096 positions, beta 32/1), in fresh processes (Megatron's parallel state and the
compat layer are process-global); results as JSON.

The checkpoint (``yarn``): the tiny DeepSeek-V3 of _tiny_deepseek_v3.py with its
``config.json`` rewritten in the release's form (``rope_scaling`` with ``"type": "yarn"``,
top-level ``rope_theta``, ``max_position_embeddings`` 163840, no ``rope_parameters``).

    python _deepseek_v3_yarn_checks.py ref TMP
        writes the checkpoint; transformers' logprobs of the 8 samples (and of the same weights
        with plain RoPE, with plain RoPE frequencies but YaRN's softmax scale, and with the
        softmax mscale taken out, to show each matters); the 1-process trainer's logprobs, its
        MLA softmax scale and rope type, and its logprobs with the softmax mscale dropped; a
        qwen3_moe with YaRN (GQA: GPTModel's rotary embedding) against transformers; HF -> Megatron -> HF conversion (tools/) at 1 process
        -> TMP/ref.json
    torchrun --nproc_per_node 2 _deepseek_v3_yarn_checks.py run TMP OUT.json tp2
        the trainer at TP2 (+SP): logprobs; HF -> Megatron at TP2 and back read at TP2
"""

from __future__ import annotations

import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (HERE, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tools"), ROOT):
    sys.path.insert(0, p)

import torch  # noqa: E402
from _checks import hf_response_logprobs, main, samples, trainer_cfg  # noqa: E402

#: the released DeepSeek-V3 config.json's rope fields
RELEASED_ROPE = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                 "original_max_position_embeddings": 4096, "type": "yarn"}


def make_yarn_checkpoint(path: str) -> str:
    """The tiny DeepSeek-V3 (q_lora 32, untied) with the release's rope fields in its config.json."""
    from _tiny_deepseek_v3 import make_tiny_deepseek_v3

    make_tiny_deepseek_v3(path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("rope_parameters", None)
    cfg.update(rope_scaling=dict(RELEASED_ROPE), rope_theta=10000, max_position_embeddings=163840)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def hf_logprobs(path: str, **config_changes) -> list[list[float]]:
    """transformers' response logprobs of the samples; ``config_changes`` edit the loaded config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    for k, v in config_changes.items():
        setattr(cfg, k, v)
    m = AutoModelForCausalLM.from_pretrained(path, config=cfg).eval()
    return hf_response_logprobs(m, samples())


def hf_logprobs_softmax_scale(path: str, mscale2: float, **config_changes) -> list[list[float]]:
    """transformers' logprobs with every attention's softmax scale set to
    ``mscale2 / sqrt(q_head_dim)``; ``config_changes`` as :func:`hf_logprobs`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    for k, v in config_changes.items():
        setattr(cfg, k, v)
    m = AutoModelForCausalLM.from_pretrained(path, config=cfg).eval()
    for layer in m.model.layers:
        layer.self_attn.scaling = mscale2 * layer.self_attn.qk_head_dim ** -0.5
    return hf_response_logprobs(m, samples())


def mla_modules(tr):
    return [m for m in tr.model.modules() if type(m).__name__ == "MLASelfAttention"]


def drop_softmax_mscale(tr) -> None:
    """Set every MLA core attention's softmax scale to 1/sqrt(q_head_dim) (no YaRN mscale^2)."""
    for m in mla_modules(tr):
        m.core_attention.softmax_scale = 1.0 / math.sqrt(m.q_head_dim)


def convert_round_trip(src: str, meg: str, back: str, tp: int = 1) -> dict:
    """HF ``src`` -> Megatron ``meg`` -> HF ``back`` with tools/ at TP ``tp``; every tensor
    bit-exact and the rope fields of config.json kept."""
    import convert_hf_to_megatron as h2m
    import convert_megatron_to_hf as m2h

    h2m.main(["--hf", src, "--out", meg, "--tp", str(tp), "--no-progress"])
    m2h.main(["--megatron", meg, "--hf-config", src, "--out", back, "--tp", str(tp), "--no-progress"])
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return {}
    from safetensors.torch import load_file

    a, b = load_file(os.path.join(src, "model.safetensors")), {}
    for fn in sorted(os.listdir(back)):
        if fn.endswith(".safetensors"):
            b.update(load_file(os.path.join(back, fn)))
    with open(os.path.join(back, "config.json")) as f:
        cb = json.load(f)
    return {"bit_exact": set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a),
            "n_tensors": len(a), "rope_kept": cb.get("rope_scaling") == RELEASED_ROPE or
            {k: v for k, v in (cb.get("rope_parameters") or {}).items() if k != "rope_theta"} == {
                **RELEASED_ROPE, "rope_type": "yarn"}}


QWEN3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8}


def make_qwen3_yarn(path: str) -> tuple[list, list]:
    """The tiny qwen3_moe with YaRN rope_parameters (factor 4 over 8 positions: the samples'
    9..13 tokens run past it); transformers' logprobs with it and with plain RoPE."""
    from _tiny import make_tiny_qwen3_moe

    make_tiny_qwen3_moe(path, rope_parameters=dict(QWEN3_YARN))
    return hf_logprobs(path), hf_logprobs(path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def main_ref(tmp: str) -> None:
    path = make_yarn_checkpoint(os.path.join(tmp, "yarn"))
    res: dict = {"hf": hf_logprobs(path),
                 "hf_plain_rope": hf_logprobs(path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                 "hf_no_softmax_mscale": hf_logprobs_softmax_scale(path, 1.0),
                 # plain RoPE frequencies, YaRN's softmax scale: the frequencies alone matter too
                 "hf_plain_freqs": hf_logprobs_softmax_scale(path, (0.1 * math.log(40) + 1) ** 2, rope_parameters={
                     "rope_type": "default", "rope_theta": 10000.0})}
    from moe_async.models import get_family
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    res["rope_row"] = get_family("deepseek_v3").arch_args(path).rope.describe()
    tr = MegatronTrainer(trainer_cfg(), path)
    mla = mla_modules(tr)
    res["rope_types"] = sorted({type(m.rotary_pos_emb).__name__ for m in mla})
    res["softmax_scales"] = sorted({m.core_attention.softmax_scale * math.sqrt(m.q_head_dim) for m in mla})
    res["tp1"] = tr.compute_logprobs(samples())
    drop_softmax_mscale(tr)
    res["tp1_no_softmax_mscale"] = tr.compute_logprobs(samples())
    tr.close()
    res["convert_tp1"] = convert_round_trip(path, os.path.join(tmp, "meg1"), os.path.join(tmp, "back1"))
    # a GQA family with YaRN (GPTModel's YarnRotaryEmbedding): qwen3_moe, factor 4 over 8 positions
    q = os.path.join(tmp, "qwen3_yarn")
    res["qwen3_hf"], res["qwen3_hf_plain"] = make_qwen3_yarn(q)
    tr = MegatronTrainer(trainer_cfg(), q)
    res["qwen3_pos_emb"] = type(tr.model.rotary_pos_emb).__name__
    res["qwen3_tp1"] = tr.compute_logprobs(samples())
    tr.close()
    with open(os.path.join(tmp, "ref.json"), "w") as f:
        json.dump(res, f)


def run_case(tmp: str, case: str) -> dict:
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    assert case == "tp2", case
    path = os.path.join(tmp, "yarn")
    tr = MegatronTrainer(trainer_cfg(2), path)
    res = {"logp": tr.compute_logprobs(samples())}
    tr.close()
    res["convert_tp2"] = convert_round_trip(path, os.path.join(tmp, "meg2"), os.path.join(tmp, "back2"), tp=2)
    return res


if __name__ == "__main__":
    main(main_ref, run_case, barrier=True, wall=False)

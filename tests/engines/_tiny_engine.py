"""A real embedded engine serving a tiny random Mixtral with the SmolLM2 tokenizer (ChatML
template, vocab 49152): text prompts, stop strings, special tokens and chat templates are
real. Shared by the /generate field table, the OpenAI API and the sglang frontend tests."""

from __future__ import annotations

import contextlib
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))


@contextlib.contextmanager
def launch_tiny_chat_engine(model_dir, **cfg_kw):
    """Yields ``SimpleNamespace(url, model, tokenizer, model_dir, log_path)``: ``model`` is the served
    weights loaded by transformers (fp32, eval) for reference outputs."""
    from _tiny import make_tiny_mixtral
    from transformers import AutoModelForCausalLM

    from moe_async.engines.base import make_engine
    from moe_async.engines.config import EngineConfig
    from moe_async.models.prepare import load_smollm2_tokenizer

    model_dir = str(model_dir)
    tok = load_smollm2_tokenizer()
    make_tiny_mixtral(model_dir, vocab_size=len(tok), max_position_embeddings=256, bos_token_id=1,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=1)
    tok.save_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    eng = make_engine(EngineConfig(startup_timeout_s=180, num_threads=1, max_running_requests=16,
                                   **cfg_kw), model_dir, 0)
    eng.launch()
    try:
        yield SimpleNamespace(url=eng.url, model=model, tokenizer=tok, model_dir=model_dir, log_path=eng.log_path)
    finally:
        eng.shutdown()

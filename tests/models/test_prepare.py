"""prepare_hf_checkpoint: random_moe determinism and loadability, cache reuse, atomic
writes, source=hf validation; tools/upcycle.py CLI (with a tiny stand-in dense model)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_async.models import prepare as prep
from moe_async.models.config import ModelConfig


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def _rand_cfg(tmp: Path, **kw) -> ModelConfig:
    return ModelConfig(source="random_moe", cache_dir=str(tmp), num_layers=2, hidden_size=32,
                       intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                       num_experts=4, top_k=2, **kw)


def test_random_moe_deterministic_and_loadable(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, MixtralForCausalLM

    a = prep.prepare_hf_checkpoint(_rand_cfg(tmp_path / "a"))
    b = prep.prepare_hf_checkpoint(_rand_cfg(tmp_path / "b"))
    assert a.name == b.name
    names = {p.name for p in a.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= names
    assert "chat_template.jinja" in names or "chat_template" in (a / "tokenizer_config.json").read_text()
    da, db = _digest(a), _digest(b)
    assert da == db  # same seed -> same bytes
    c = prep.prepare_hf_checkpoint(_rand_cfg(tmp_path / "c", init_seed=99))
    assert _digest(c)["model.safetensors"] != da["model.safetensors"]

    cfg = json.loads((a / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True and cfg["num_local_experts"] == 4
    assert cfg["rope_parameters"]["rope_theta"] == 1e5
    state = torch.get_rng_state()
    m = AutoModelForCausalLM.from_pretrained(a)
    assert type(m) is MixtralForCausalLM
    with torch.no_grad():
        out = m(torch.tensor([[1, 2, 3, 4]])).logits
    assert out.shape == (1, 4, 49152) and torch.isfinite(out).all()
    tok = prep.load_tokenizer(a)
    assert len(tok) == 49152 and tok.eos_token_id == 2 and tok.pad_token_id is not None
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert torch.equal(torch.get_rng_state(), state)


def test_generic_tokenizer_equals_auto_tokenizer_without_its_imports(tmp_path) -> None:
    """load_tokenizer of a tokenizer_config.json naming the generic backend: the class, ids, chat
    template, special tokens and pad AutoTokenizer gives, in a process that never imports
    transformers' auto registry; another class name (or no config) still goes through AutoTokenizer."""
    from transformers import AutoTokenizer

    a = prep.prepare_hf_checkpoint(_rand_cfg(tmp_path / "a"))
    msgs = [{"role": "user", "content": "12 + 7 = ? é <|im_end|>"}]
    code = ("import json, sys\nfrom moe_async.models.prepare import load_tokenizer\n"
            f"t = load_tokenizer({str(a)!r})\n"
            f"m = {msgs!r}\n"
            "print(json.dumps([type(t).__name__, t(m[0]['content'])['input_ids'], t.apply_chat_template(m, "
            "add_generation_prompt=True, tokenize=False), t.all_special_ids, t.pad_token_id, "
            "'transformers.models.auto.tokenization_auto' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    ref = AutoTokenizer.from_pretrained(str(a))
    ref.pad_token = ref.pad_token or ref.eos_token
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        type(ref).__name__, ref(msgs[0]["content"])["input_ids"],
        ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), ref.all_special_ids,
        ref.pad_token_id, False]
    tc = json.loads((a / "tokenizer_config.json").read_text())
    (a / "tokenizer_config.json").write_text(json.dumps({**tc, "tokenizer_class": "GPT2Tokenizer"}))
    assert type(prep.load_tokenizer(a)).__name__ == type(AutoTokenizer.from_pretrained(str(a))).__name__


def test_cache_reused(tmp_path) -> None:
    cfg = _rand_cfg(tmp_path)
    p = prep.prepare_hf_checkpoint(cfg)
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    assert prep.prepare_hf_checkpoint(cfg) == p
    assert (p / "model.safetensors").stat().st_mtime_ns == mtime
    assert [d.name for d in tmp_path.iterdir() if not d.name.startswith(".")] == [p.name]


def test_failed_write_leaves_nothing(tmp_path, monkeypatch) -> None:
    cfg = _rand_cfg(tmp_path)

    tok_cls = type(prep.load_smollm2_tokenizer())

    def bad_save(self, *a, **k):  # the model is written, then the run is killed
        raise KeyboardInterrupt("killed")

    with monkeypatch.context() as mp:
        mp.setattr(tok_cls, "save_pretrained", bad_save)
        with pytest.raises(KeyboardInterrupt):
            prep.prepare_hf_checkpoint(cfg)
    assert [d for d in tmp_path.iterdir() if d.is_dir()] == []  # no half checkpoint, no temp dir
    p = prep.prepare_hf_checkpoint(cfg)
    assert (p / "config.json").is_file()


def test_source_hf(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        prep.prepare_hf_checkpoint(ModelConfig(source="hf", hf_path=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        prep.prepare_hf_checkpoint(ModelConfig(source="hf", hf_path=str(tmp_path / "empty")))
    p = prep.prepare_hf_checkpoint(_rand_cfg(tmp_path / "c"))
    assert prep.prepare_hf_checkpoint(ModelConfig(source="hf", hf_path=str(p))) == p


def _tiny_dense():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e5},
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval(), prep.load_smollm2_tokenizer()


def test_smollm2_upcycled_path_cached(tmp_path, monkeypatch) -> None:
    """The smollm2_upcycled path (load -> upcycle -> atomic save -> reuse), with a tiny
    stand-in for the 135M dense model so the test stays fast."""
    from transformers import AutoModelForCausalLM

    import moe_async.models.upcycle as up

    calls = []

    def fake_load(gguf_path=None):
        calls.append(1)
        return _tiny_dense()

    monkeypatch.setattr(up, "load_smollm2_dense", fake_load)
    cfg = ModelConfig(source="smollm2_upcycled", cache_dir=str(tmp_path), num_experts=4, top_k=2)
    p = prep.prepare_hf_checkpoint(cfg)
    assert prep.prepare_hf_checkpoint(cfg) == p and len(calls) == 1
    m = AutoModelForCausalLM.from_pretrained(p)
    assert m.config.num_local_experts == 4 and m.config.rope_parameters["rope_theta"] == 1e5
    other = prep.prepare_hf_checkpoint(ModelConfig(source="smollm2_upcycled", cache_dir=str(tmp_path),
                                                   num_experts=2, top_k=1))
    assert other != p and len(calls) == 2


def test_cli_help() -> None:
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "tools" / "upcycle.py"), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--num-experts" in r.stdout and "--top-k" in r.stdout


def test_source_hf_rejects_unloadable_dir(tmp_path) -> None:
    """A model.hf_path no engine could load fails at prepare, naming the file (not 15 s later
    inside an engine's start-up log with Transformers' 'upgrade' advice)."""
    import shutil

    src = prep.prepare_hf_checkpoint(_rand_cfg(tmp_path / "c"))

    def _copy(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(src, d)
        return d

    bad_type = _copy("bad_type")
    cfg = json.loads((bad_type / "config.json").read_text())
    cfg["model_type"] = "not_a_family"
    (bad_type / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json.*unsupported HF model_type 'not_a_family'"):
        prep.prepare_hf_checkpoint(ModelConfig(source="hf", hf_path=str(bad_type)))

    no_weights = _copy("no_weights")
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        prep.prepare_hf_checkpoint(ModelConfig(source="hf", hf_path=str(no_weights)))

    corrupt = _copy("corrupt")
    f = next(corrupt.glob("*.safetensors"))
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    with pytest.raises(ValueError, match=f"{f.name}.*truncated or corrupt"):
        prep.prepare_hf_checkpoint(ModelConfig(source="hf", hf_path=str(corrupt)))

    garbage = _copy("garbage")
    next(garbage.glob("*.safetensors")).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        prep.prepare_hf_checkpoint(ModelConfig(source="hf", hf_path=str(garbage)))

"""Produce the Hugging Face checkpoint directory that engines and trainers load.

``prepare_hf_checkpoint(cfg)`` returns a directory holding ``config.json``,
``model*.safetensors``, the tokenizer files and the chat template. Made checkpoints are
cached under ``cfg.cache_dir`` (default ``~/.cache/moe-async``) in a sub-directory named by
a hash of the fields that determine the weights; they are written to a temporary
directory and renamed into place, so a killed run never leaves a half-written checkpoint,
and a present one is reused. Nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import torch

from moe_async.errors import UserInputError, UserInputFileNotFoundError, read_json_object
from moe_async.models.config import ModelConfig

log = logging.getLogger(__name__)

# Bump when the layout of made checkpoints changes (invalidates caches).
_FORMAT_VERSION = 1
_SMOLLM2_VOCAB = 49152


def default_cache_dir() -> Path:
    return Path(os.environ.get("MOE_ASYNC_CACHE", Path.home() / ".cache" / "moe-async"))


def _cache_key(cfg: ModelConfig) -> str:
    """Hash of the config fields that determine the produced weights."""
    from moe_async.models.upcycle import find_smollm2_gguf

    fields: dict = {"format": _FORMAT_VERSION, "source": cfg.source, "init_seed": cfg.init_seed,
                    "num_experts": cfg.num_experts, "top_k": cfg.top_k,
                    "router_init_std": cfg.router_init_std}
    gguf = find_smollm2_gguf()
    fields["gguf"] = [gguf.name, gguf.stat().st_size]
    if cfg.source == "random_moe":
        for k in ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings"):
            fields[k] = getattr(cfg, k)
    blob = json.dumps(fields, sort_keys=True).encode()
    return f"{cfg.source}-{hashlib.sha256(blob).hexdigest()[:16]}"


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors")) and (
        path / "tokenizer_config.json"
    ).is_file()


@contextlib.contextmanager
def _file_lock(lock_path: Path):
    """Inter-process lock so concurrent callers do not make the same checkpoint twice."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def save_checkpoint_atomic(model, tokenizer, final: Path) -> Path:
    """Save ``model`` + ``tokenizer`` to ``final`` via a temp dir in the same parent + rename."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        for f in tmp.iterdir():  # safetensors may be written 0600; readers can be other users
            f.chmod(0o644)
        if not _is_complete(tmp):
            raise RuntimeError(f"incomplete checkpoint written to {tmp}: {sorted(os.listdir(tmp))}")
        try:
            os.rename(tmp, final)
        except OSError:
            if _is_complete(final):  # someone else finished first
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# tokenizer_config.json classes that name transformers' generic tokenizer.json backend: loaded
# by that class directly, the object AutoTokenizer would build, without AutoTokenizer's imports
# (transformers' model registry and torch: ~4 s of CPU in every process that loads one)
_GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(path: str | Path):
    """Tokenizer of a checkpoint dir (pad = eos when the tokenizer has no pad token): transformers'
    ``AutoTokenizer``, or, when ``tokenizer_config.json`` names the generic ``tokenizer.json``
    backend and that file exists, that class itself (the same object, without importing torch)."""
    p = Path(path)
    try:
        cls_name = json.loads((p / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        cls_name = None  # AutoTokenizer names what is missing or wrong
    if cls_name in _GENERIC_TOKENIZER_CLASSES and (p / "tokenizer.json").is_file():
        from transformers import TokenizersBackend

        tok = TokenizersBackend.from_pretrained(str(path))
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer_cached():
    from transformers import AutoTokenizer

    from moe_async.models.upcycle import find_smollm2_gguf

    gguf = find_smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_smollm2_tokenizer():
    """The SmolLM2-135M-Instruct tokenizer (ChatML template) from the GGUF file.

    Parsed once per process (~5 s); each call returns a private copy.
    """
    return copy.deepcopy(_smollm2_tokenizer_cached())


def random_moe_config(cfg: ModelConfig, vocab_size: int = _SMOLLM2_VOCAB, bos_token_id: int = 1,
                      eos_token_id: int = 2, pad_token_id: int = 2):
    """The ``MixtralConfig`` of :func:`build_random_moe` (tied embeddings, rope_theta 1e5)."""
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=True,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        rope_parameters={"rope_type": "default", "rope_theta": 1e5},
        sliding_window=None,
        router_jitter_noise=0.0,
    )


def build_random_moe(cfg: ModelConfig, vocab_size: int = _SMOLLM2_VOCAB, bos_token_id: int = 1,
                     eos_token_id: int = 2, pad_token_id: int = 2):
    """Random-init ``MixtralForCausalLM`` of ``cfg``'s sizes (:func:`random_moe_config`),
    deterministic in ``cfg.init_seed``. Router ~ N(0, cfg.router_init_std). The global torch
    RNG state is left untouched.
    """
    from transformers import MixtralForCausalLM

    mcfg = random_moe_config(cfg, vocab_size, bos_token_id, eos_token_id, pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        model = MixtralForCausalLM(mcfg).float()
        gen = torch.Generator().manual_seed(cfg.init_seed + 1)
        with torch.no_grad():
            for layer in model.model.layers:
                w = layer.mlp.gate.weight
                w.copy_(torch.randn(w.shape, generator=gen) * cfg.router_init_std)
    model.eval()
    return model


def _make(cfg: ModelConfig, final: Path) -> Path:
    if cfg.source == "smollm2_upcycled":
        from moe_async.models.upcycle import load_smollm2_dense, upcycle_llama_to_mixtral

        dense, tok = load_smollm2_dense()
        model = upcycle_llama_to_mixtral(
            dense, cfg.num_experts, cfg.top_k, cfg.router_init_std, cfg.init_seed
        )
        del dense
    elif cfg.source == "random_moe":
        tok = load_smollm2_tokenizer()
        if len(tok) != _SMOLLM2_VOCAB:
            log.warning("SmolLM2 tokenizer has %d tokens, expected %d", len(tok), _SMOLLM2_VOCAB)
        model = build_random_moe(cfg, vocab_size=max(len(tok), _SMOLLM2_VOCAB),
                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
    else:  # pragma: no cover - guarded by caller
        raise ValueError(cfg.source)
    return save_checkpoint_atomic(model, tok, final)


def _check_hf_dir(p: Path) -> None:
    """Fail fast, naming the file, on a ``model.hf_path`` no engine or trainer could load:
    an unreadable ``config.json``, an unsupported ``model_type``, no ``*.safetensors``, or a
    safetensors file whose header cannot be read (truncated / corrupt).

    Raises: UserInputError, a ValueError (config.json, model_type, corrupt file), or
    UserInputFileNotFoundError, a FileNotFoundError too (no safetensors file).
    """
    from moe_async.models.family import get_family

    cfg_path = p / "config.json"
    hf_cfg = read_json_object(cfg_path, "model.hf_path")  # UserInputError naming the file
    try:
        get_family(hf_cfg.get("model_type"))
    except ValueError as e:
        raise UserInputError(f"model.hf_path: {cfg_path}: {e}") from None
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise UserInputFileNotFoundError(f"model.hf_path {p} has no *.safetensors weight file")
    for f in files:
        try:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                head = fh.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if n <= 0 or 8 + n > size:
                    raise ValueError(f"header length {n} does not fit in {size} bytes")
                header = json.loads(fh.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
            if 8 + n + end != size:
                raise ValueError(f"tensor data ends at byte {8 + n + end}, file has {size} bytes")
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise UserInputError(f"model.hf_path: {f} is not a readable safetensors file "
                                 f"(truncated or corrupt): {e}") from e


def configured_hf_config(cfg: ModelConfig) -> dict | None:
    """The HF config (a dict) of the model ``cfg`` describes, without making it: ``hf``: its
    ``config.json``; a made source: the cached checkpoint's ``config.json`` when it is made,
    else for ``random_moe`` :func:`random_moe_config` (the SmolLM2 vocabulary). None when it
    cannot be known yet (``smollm2_upcycled`` not made, an unreadable ``config.json``)."""
    try:
        if cfg.source == "hf":
            assert cfg.hf_path is not None  # required with source: hf
            p = Path(cfg.hf_path).expanduser() / "config.json"
        else:
            root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
            p = root / _cache_key(cfg) / "config.json"
            if not _is_complete(p.parent):
                return random_moe_config(cfg).to_dict() if cfg.source == "random_moe" else None
        d = json.loads(p.read_text())
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def prepare_hf_checkpoint(cfg: ModelConfig) -> Path:
    """Return a HF checkpoint directory for ``cfg`` (made and cached when needed).

    * ``hf``: ``cfg.hf_path`` after checking it exists and holds ``config.json``.
    * ``smollm2_upcycled``: SmolLM2-135M-Instruct upcycled to ``cfg.num_experts`` experts,
      top-``cfg.top_k`` (see :mod:`moe_async.models.upcycle`).
    * ``random_moe``: random Mixtral of ``cfg``'s sizes with the SmolLM2 tokenizer.

    Raises:
        UserInputFileNotFoundError (a FileNotFoundError and a
        :class:`~moe_async.errors.UserInputError`) or UserInputError, naming ``model.hf_path``,
        when ``hf_path`` is no loadable HF model directory (see :func:`_check_hf_dir`).
    """
    if cfg.source == "hf":
        assert cfg.hf_path is not None  # required with source: hf
        p = Path(cfg.hf_path).expanduser()
        if not p.is_dir():
            raise UserInputFileNotFoundError(f"model.hf_path {p} is not a directory")
        if not (p / "config.json").is_file():
            raise UserInputFileNotFoundError(f"model.hf_path {p} has no config.json")
        _check_hf_dir(p)
        return p
    root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    final = root / _cache_key(cfg)
    if _is_complete(final):
        return final
    with _file_lock(root / f".{final.name}.lock"):
        if _is_complete(final):
            return final
        if final.exists():  # not produced by us (rename is atomic): refuse to clobber silently
            raise RuntimeError(f"{final} exists but is not a complete checkpoint; remove it")
        log.info("making %s checkpoint at %s", cfg.source, final)
        return _make(cfg, final)

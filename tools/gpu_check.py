"""GPU check: one GPU, no package index; a bf16 Megatron step, the HF export, SGLang's bucket,
CUDA-IPC weight sync into the embedded engine, a checkpoint round trip; one JSON line.

    python tools/gpu_check.py [--device cuda|cpu] [--tensor-bucket PATH] [--work-dir DIR]

Where it runs: Python 3.12 with a CUDA torch (2.11 or newer) already installed and no package
index; the rest comes from at most 30 MB of wheels carried beside the repository, made here by
``make gpu-check-wheels`` (``shared/wheels``: megatron-core 0.16.1, transformers, ... for cp312,
and ``tensor_bucket.py`` taken out of the sglang 0.5.23 wheel) and installed there with
``pip install --no-index --no-deps shared/wheels/*.whl`` (torch, numpy and torch's own
dependencies are taken as installed; checked here in a venv holding only those and the wheels). ``--device cpu`` is the same code on
the CPU (the suite's dry run: tests/tools/test_gpu_check.py); CUDA is then hidden from it.

Steps (each printed PASS/FAIL with its time; the first failure ends the run):
  1. ``tiny model``: a random Mixtral-style MoE (2 layers, hidden 64, 4 experts top-2, vocab 256),
     fp32 safetensors, no tokenizer;
  2. ``fp32 reference step (cpu)``: a 1-process MegatronTrainer (fp32, distributed optimizer as
     configs/base/gpu_grpo.yaml, CUDA hidden, a child process) takes one GRPO step on fixed
     samples; its loss is the reference;
  3. ``HF export``: a bf16 MegatronTrainer on ``--device`` (Transformer Engine spec when TE is
     importable, else the local spec) exports every HF tensor; names and shapes equal the
     checkpoint's, values equal it cast to each tensor's dtype (bf16; norms stay fp32);
  4. ``bf16 train step``: the same step; ``|loss - reference| <= LOSS_RTOL * max(1, |reference|)``;
  5. ``FlattenedTensorBucket``: SGLang's own class (``sglang/srt/weight_sync/tensor_bucket.py``;
     imports only torch) packs the exported tensors on the device into buckets of
     ``BUCKET_BYTES`` and rebuilds every one equal (name, dtype, shape, values);
  6. ``engine sync + greedy``: the embedded engine (a server process, fp32, ``engine.device`` =
     ``--device``: the model and every forward on that GPU; its ``/get_server_info`` must say so)
     receives the trained weights over ``TensorTransport`` (CUDA IPC handles to the trainer's GPU
     memory, opened in the engine process and copied into its CUDA parameters; CPU shared memory
     with ``--device cpu``); its per-tensor checksums equal the trainer's, and its greedy output
     equals HF ``transformers``' greedy on the same weights (HF fp32 on the CPU);
  7. ``checkpoint round trip``: ``save_checkpoint`` then a second trainer's ``load_checkpoint``:
     same version, every exported tensor equal, and the next train step's loss equal on both.
The last line printed is one JSON object: ``device``, ``torch``, ``cuda``, ``te`` (TE importable),
``loss`` / ``reference_loss``, and per step ``{"result": "pass"|"fail", "seconds": s, "note"}``.
Exit code 0 when every step passed; 1 when one failed; 2 when ``--device cuda`` sees no GPU.
Importing this module starts nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # moe_async from this checkout where it is not installed (the GPU machine)
    sys.path.insert(0, str(ROOT))
#: bf16 against fp32 on the same samples: relative loss tolerance (bf16 keeps 8 mantissa bits)
LOSS_RTOL = 0.02
#: bytes per FlattenedTensorBucket (small, so the tiny model needs several)
BUCKET_BYTES = 64 * 1024
#: where ``make gpu-check-wheels`` puts SGLang's module
DEFAULT_BUCKET_FILE = ROOT / "shared" / "wheels" / "tensor_bucket.py"
TENSOR_BUCKET_IN_WHEEL = "sglang/srt/weight_sync/tensor_bucket.py"
ADVANTAGES = [1.0, -0.5, 0.7, -1.2, 3.0, 0.4, -0.9, 1.5]
VOCAB = 256


class Checks:
    """Runs named steps, prints ``[PASS|FAIL] name (s) note``; the first failure ends the run
    (``SystemExit`` with the summary's exit code)."""

    def __init__(self, facts: dict):
        self.facts = facts
        self.results: list[tuple[str, str, float, str]] = []

    def run(self, name, fn):
        t0 = time.perf_counter()
        try:
            out, result, note = fn(), "pass", ""
        except Exception as e:  # report, then the summary
            out, result, note = None, "fail", f"{type(e).__name__}: {e}"
            traceback.print_exc()
        dt = time.perf_counter() - t0
        self.results.append((name, result, dt, note))
        print(f"[{result.upper()}] {name} ({dt:.1f}s) {note}", flush=True)
        if result == "fail":
            raise SystemExit(self.summary())
        return out

    def summary(self) -> int:
        bad = any(r[1] == "fail" for r in self.results)
        steps = {n: {"result": r, "seconds": round(dt, 3), **({"note": note} if note else {})}
                 for n, r, dt, note in self.results}
        print(f"gpu_check: {sum(r[1] == 'pass' for r in self.results)}/{len(self.results)} passed; "
              f"{'FAIL' if bad else 'PASS'}", flush=True)
        print(json.dumps({**self.facts, "steps": steps}), flush=True)
        return 1 if bad else 0


def load_tensor_bucket(path: str | Path | None = None):
    """SGLang's ``FlattenedTensorBucket`` class from ``path`` (``tensor_bucket.py``, or an sglang
    wheel holding it), else from an installed sglang (its file, without importing the package),
    else from :data:`DEFAULT_BUCKET_FILE`. Raises FileNotFoundError naming what was tried."""
    tried = []
    if path is None:
        spec = importlib.util.find_spec("sglang")
        if spec is not None and spec.submodule_search_locations:
            path = Path(spec.submodule_search_locations[0]).parent / TENSOR_BUCKET_IN_WHEEL
        else:
            path = DEFAULT_BUCKET_FILE
    path = Path(path)
    tried.append(str(path))
    if path.suffix == ".whl" and path.is_file():
        with zipfile.ZipFile(path) as z:
            source = z.read(TENSOR_BUCKET_IN_WHEEL).decode()
    elif path.is_file():
        source = path.read_text()
    else:
        raise FileNotFoundError(f"SGLang's tensor_bucket.py not found (tried {tried}); "
                                f"`make gpu-check-wheels` puts it in shared/wheels, or pass --tensor-bucket")
    mod = type(sys)("sglang_tensor_bucket")
    mod.__file__ = str(path)
    sys.modules[mod.__name__] = mod  # dataclasses resolve their module by name
    exec(compile(source, str(path), "exec"), mod.__dict__)
    return mod.FlattenedTensorBucket


def bucket_round_trip(bucket_cls, named: list, bucket_bytes: int) -> int:
    """Pack ``named`` ``(name, tensor)`` into ``bucket_cls`` buckets of one dtype each (SGLang
    views each tensor out of the flat bytes at its offset, so a bucket keeps its offsets
    aligned by holding one dtype, as SGLang's senders group them) of at most ``bucket_bytes``
    (a larger tensor alone), in order within a dtype; rebuild each from its flat uint8 tensor
    and metadata, and check every tensor equal (name, dtype, shape, values). Returns the bucket
    count. Raises AssertionError naming the first tensor that differs."""
    groups, open_ = [], {}
    for n, t in named:
        nb = t.numel() * t.element_size()
        cur = open_.get(t.dtype)
        if cur is None or (cur[0] and cur[1] + nb > bucket_bytes):
            cur = open_[t.dtype] = [[], 0]
            groups.append(cur[0])
        cur[0].append((n, t))
        cur[1] += nb
    for group in groups:
        packed = bucket_cls(named_tensors=group)
        flat = packed.get_flattened_tensor().clone()  # what a receiver holds: bytes + metadata only
        rebuilt = bucket_cls(flattened_tensor=flat, metadata=packed.get_metadata()).reconstruct_tensors()
        assert [n for n, _ in rebuilt] == [n for n, _ in group], "bucket names/order differ"
        for (n, want), (_, got) in zip(group, rebuilt):
            import torch

            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), \
                f"{n}: rebuilt {got.dtype} {tuple(got.shape)} differs from {want.dtype} {tuple(want.shape)}"
    return len(groups)


def make_tiny_model(path: Path) -> str:
    """A random Mixtral-style MoE (fp32 safetensors, config, no tokenizer) in ``path``."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(1234)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
                        initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = MixtralForCausalLM(cfg)
    model.save_pretrained(str(path))
    return str(path)


def samples(seed: int):
    """Eight GRPO samples (prompt 6-11 tokens, response 5-12) with rollout logprobs in (-6, 0]."""
    import torch

    from moe_async.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(len(ADVANTAGES)):
        p, r = 6 + i % 6, 5 + (3 * i) % 8
        ids = torch.randint(3, VOCAB, (p + r,), generator=g).tolist()
        rl = (-torch.rand(r, generator=g) * 6).tolist()
        out.append(Sample(prompt_ids=ids[:p], response_ids=ids[p:], rollout_logprobs=rl,
                          weight_versions=[0] * r, loss_weight=1.0))
    return out


def trainer_config(dtype: str):
    """The 1-process trainer: ``dtype`` parameters and, as configs/base/gpu_grpo.yaml, Megatron's
    distributed optimizer (fp32 main parameters and Adam state)."""
    from moe_async.trainer.config import TrainerConfig

    return TrainerConfig(params_dtype=dtype, use_distributed_optimizer=True, micro_batch_size=4,
                         moe_aux_loss_coeff=0.0, lr=1e-3, num_threads=1)


def reference_loss(model_dir: str) -> float:
    """The fp32 1-process step's loss on the CPU, in a child process with CUDA hidden."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ref.json"
        p = subprocess.run([sys.executable, __file__, "--reference-step", model_dir, str(out)], env=env,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
        if p.returncode != 0 or not out.is_file():
            raise RuntimeError(f"reference step exited {p.returncode}: {p.stderr[-3000:]}")
        return float(json.loads(out.read_text())["loss"])


def _reference_main(model_dir: str, out: str) -> int:
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer(trainer_config("fp32"), model_dir)
    try:
        loss = trainer.train_step(samples(0), ADVANTAGES)["loss"]
    finally:
        trainer.close()
    Path(out).write_text(json.dumps({"loss": loss}))
    return 0


def hf_greedy(model_dir: str, weights: dict, prompt: list[int], n: int, out_dir: Path) -> list[int]:
    """Greedy continuation (``n`` tokens, no EOS stop) by HF ``transformers`` on ``weights``
    (HF on-disk name -> tensor), saved with ``model_dir``'s config to ``out_dir`` and loaded by
    ``from_pretrained`` (its own per-expert -> fused conversion), fp32 on the CPU, one full
    forward per token."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(model_dir) / "config.json", out_dir / "config.json")
    save_file({k: v.float().cpu().contiguous() for k, v in weights.items()}, str(out_dir / "model.safetensors"))
    m = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(m(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda: the check (exit 2 without a GPU); cpu: the same steps on the CPU, CUDA hidden")
    ap.add_argument("--tensor-bucket", default=None,
                    help="SGLang's tensor_bucket.py or an sglang wheel (default: installed sglang, else "
                         "shared/wheels/tensor_bucket.py)")
    ap.add_argument("--work-dir", default=None, help="for the model and the checkpoint (default: a temp dir)")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="engine start-up bound (s)")
    ap.add_argument("--reference-step", nargs=2, metavar=("MODEL_DIR", "OUT_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.startup_timeout <= 0:
        ap.error(f"--startup-timeout must be > 0, got {args.startup_timeout}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.reference_step:
        return _reference_main(*args.reference_step)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch: the trainer takes CUDA when it sees one
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but no CUDA device visible; nothing checked", flush=True)
        return 2
    facts = {"device": args.device, "torch": torch.__version__, "cuda": torch.version.cuda,
             "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
             "te": importlib.util.find_spec("transformer_engine") is not None}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        return _run(args, facts, work)


def _run(args, facts: dict, work: Path) -> int:
    import httpx
    import torch
    from safetensors.torch import load_file

    from moe_async.engines.base import make_engine
    from moe_async.engines.client import SyncEngineClient
    from moe_async.engines.config import EngineConfig
    from moe_async.models.checksum import tensor_checksum
    from moe_async.trainer.megatron_trainer import MegatronTrainer
    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.tensor_transport import TensorTransport
    from moe_async.weight_sync.transport import check_engines

    ck = Checks(facts)
    bucket_cls = ck.run("load SGLang FlattenedTensorBucket", lambda: load_tensor_bucket(args.tensor_bucket))
    model_dir = ck.run("tiny model", lambda: make_tiny_model(work / "model"))
    ref = ck.run("fp32 reference step (cpu)", lambda: reference_loss(model_dir))
    facts["reference_loss"] = ref
    trainer = MegatronTrainer(trainer_config("bf16"), model_dir)
    state: dict = {}

    def export_check():
        hf = load_file(str(Path(model_dir) / "model.safetensors"))
        got = {n: t for n, t in trainer.export_hf_weights()}
        assert sorted(got) == sorted(hf), sorted(set(got) ^ set(hf))
        bad = [n for n, t in got.items() if t.shape != hf[n].shape or not torch.equal(t.cpu(), hf[n].to(t.dtype))]
        assert not bad, f"exported tensors differ from the checkpoint cast to their dtype: {bad[:5]}"
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in got.values()})
        assert "bfloat16" in dtypes, dtypes
        return f"{len(got)} tensors on {next(iter(got.values())).device}, {'/'.join(dtypes)}"

    facts["export"] = ck.run("HF export", export_check)

    def step():
        loss = trainer.train_step(samples(0), ADVANTAGES)["loss"]
        facts["loss"] = loss
        assert abs(loss - ref) <= LOSS_RTOL * max(1.0, abs(ref)), f"bf16 loss {loss} vs fp32 {ref}"

    ck.run("bf16 train step", step)

    def bucket():
        named = [(n, t.detach().clone()) for n, t in trainer.export_hf_weights()]
        assert all(t.device.type == args.device for _, t in named), {t.device for _, t in named}
        state["trained"] = {n: t.cpu() for n, t in named}
        return bucket_round_trip(bucket_cls, named, BUCKET_BYTES)

    facts["buckets"] = ck.run("FlattenedTensorBucket rebuilds every tensor", bucket)

    eng = make_engine(EngineConfig(backend="embedded", dtype="fp32", device=args.device, num_threads=1,
                                   max_running_requests=4, startup_timeout_s=args.startup_timeout), model_dir, 0)

    def engine():
        eng.launch()
        served_on = httpx.get(f"{eng.url}/get_server_info", timeout=30, trust_env=False).json()["device"]
        assert served_on == args.device, f"engine runs on {served_on!r}, not --device {args.device!r}"
        c = SyncEngineClient(eng.url, timeout_s=120)
        tr = TensorTransport([c], WeightSyncConfig(transport="tensor", bucket_bytes=BUCKET_BYTES, timeout_s=120))
        try:
            tr.connect()
            m = tr.send(trainer.export_hf_weights(), trainer.version)
            check_engines([c], {n: tensor_checksum(t) for n, t in state["trained"].items()}, trainer.version)
            prompt = [5, 17, 42, 99, 7, 3]
            out = c.generate(prompt, {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True})
            want = hf_greedy(model_dir, state["trained"], prompt, 12, work / "trained_hf")
            assert list(out.output_ids) == want, f"engine greedy {list(out.output_ids)} != HF greedy {want}"
            return f"engine on {served_on}, {int(m['sync/buckets'])} buckets over {tr.device}, greedy {want}"
        finally:
            tr.shutdown()
            c.close()

    try:
        facts["engine"] = ck.run("engine sync over TensorTransport + greedy equals HF", engine)
    finally:
        eng.shutdown()

    def checkpoint():
        path = str(work / "ckpt")
        trainer.save_checkpoint(path)
        other = MegatronTrainer(trainer_config("bf16"), model_dir)
        try:
            other.load_checkpoint(path)
            assert other.version == trainer.version, (other.version, trainer.version)
            got = {n: t.cpu() for n, t in other.export_hf_weights()}
            bad = [n for n, t in state["trained"].items() if not torch.equal(got[n], t)]
            assert not bad and sorted(got) == sorted(state["trained"]), f"loaded tensors differ: {bad[:5]}"
            a = trainer.train_step(samples(1), ADVANTAGES)["loss"]
            b = other.train_step(samples(1), ADVANTAGES)["loss"]
            assert a == b, f"next step after load: loss {b} != {a} (optimizer state not restored?)"
        finally:
            other.close()

    try:
        ck.run("checkpoint round trip", checkpoint)
    finally:
        trainer.close()
    return ck.summary()


if __name__ == "__main__":
    sys.exit(main())

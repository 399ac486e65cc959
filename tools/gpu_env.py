"""Resolve the GPU environment (pyproject's ``gpu`` extra) for Linux x86_64 without installing it.

    python tools/gpu_env.py lock                 # (re)write constraints/gpu-py311.txt, gpu-py312.txt
    python tools/gpu_env.py check                # both Pythons: resolves, and the locks agree
    python tools/gpu_env.py check --python 3.12 --pin transformers==5.23.0   # a conflicting pin
    python tools/gpu_env.py wheels --dest shared/wheels   # tools/gpu_check.py's wheels (make gpu-check-wheels)

``uv pip compile`` (the ``uv`` wheel of the test extra) resolves ``pyproject.toml`` with its ``gpu``
extra (sglang 0.5.23 with all its dependencies, Transformer Engine, megatron-core and the product's
own pins) against the package index for ``x86_64-manylinux_2_34`` at each Python version; nothing is
downloaded but metadata (transformer-engine-torch is an sdist: uv builds only its metadata), and no
interpreter: the metadata builds use a local Python (uv would otherwise first try to download a
CPython of the target version, seconds of retries where that host is unreachable).
``check`` resolves with the committed lock as constraints and fails when there is no solution (a
conflict: uv's own explanation is printed) or when the resolution is not exactly the lock (a pin
changed in pyproject.toml without ``make gpu-lock``). Exit code 0: every Python resolved and agrees;
1: a conflict or drift, each named. ``wheels`` downloads (``pip download --no-deps``, cp312
manylinux x86_64, the lock's versions) what ``tools/gpu_check.py`` imports beyond a CUDA torch
install (torch, numpy and torch's own dependencies are assumed there), and takes
``tensor_bucket.py`` out of the sglang wheel (the wheel itself is not kept: 39 MB); it fails when
the folder would exceed :data:`WHEELS_MAX_BYTES`. Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PYTHONS = ("3.11", "3.12")
#: many CUDA wheels (TE, flashinfer, nccl) are manylinux_2_31 / 2_34 only
PLATFORM = "x86_64-manylinux_2_34"
#: tools/gpu_check.py's imports beyond torch/numpy (moe_async's trainer, engine server, weight sync)
CHECK_WHEELS = ("megatron-core", "transformers", "tokenizers", "huggingface-hub", "safetensors", "pyyaml",
                "regex", "tqdm", "packaging", "pydantic", "pydantic-core", "annotated-types",
                "typing-inspection", "httpx", "httpcore", "h11", "anyio", "idna", "certifi", "fastapi",
                "starlette", "annotated-doc", "uvicorn", "click", "tenacity", "einops", "psutil", "rich",
                "markdown-it-py", "mdurl", "pygments", "opentelemetry-api", "importlib-metadata", "zipp")
WHEELS_MAX_BYTES = 30 * 1000 * 1000
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def lock_path(python: str) -> Path:
    """``constraints/gpu-py312.txt`` for ``"3.12"``."""
    return ROOT / "constraints" / f"gpu-py{python.replace('.', '')}.txt"


def parse_pins(text: str) -> dict[str, str]:
    """``{normalized name: version}`` of every ``name==version`` line of a requirements text
    (comments, annotations and blank lines ignored; names lower-cased, ``_``/``.`` -> ``-``)."""
    pins = {}
    for line in text.splitlines():
        m = _PIN.match(line.strip())
        if m:
            pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


class Resolution(NamedTuple):
    """One ``uv pip compile`` outcome; ``pins`` empty when it found no solution."""

    python: str
    ok: bool
    pins: dict[str, str]
    output: str  # uv's stderr (the explanation when there is no solution)


@functools.lru_cache(maxsize=1)
def uv_bin() -> str:
    """The ``uv`` executable of the installed ``uv`` wheel (pinned in the test extra). Call it
    once before threads: its first lookup reads ``sysconfig``, which is not thread-safe."""
    from uv import find_uv_bin

    return find_uv_bin()


def resolve(python: str, constraints: list[Path] = (), pins: list[str] = (), out: Path | None = None,
            project: Path = ROOT / "pyproject.toml", timeout_s: float = 600.0) -> Resolution:
    """Resolve ``project`` (a pyproject.toml) with its ``gpu`` extra for ``python`` on
    :data:`PLATFORM` with ``constraints`` files and extra ``pins`` (``name==version`` lines, given
    as constraints); ``out``: also write the annotated result there (a lock). Raises
    ``subprocess.TimeoutExpired`` past ``timeout_s``."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [uv_bin(), "pip", "compile", str(project), "--extra", "gpu", "--no-config", "--no-python-downloads",
               "--python-version", python, "--python-platform", PLATFORM, "--quiet",
               "--custom-compile-command", "make gpu-lock"]
        for c in constraints:
            cmd += ["-c", str(c)]
        if pins:
            extra = Path(tmp) / "pins.txt"
            extra.write_text("\n".join(pins) + "\n")
            cmd += ["-c", str(extra)]
        target = out if out is not None else Path(tmp) / "resolved.txt"
        cmd += ["-o", str(target)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                           env={**os.environ, "UV_NO_PROGRESS": "1"})
        resolved = parse_pins(target.read_text()) if p.returncode == 0 else {}
    return Resolution(python, p.returncode == 0, resolved, p.stderr.strip())


def lock_problems(res: Resolution, lock: dict[str, str]) -> list[str]:
    """Why ``res`` is not exactly ``lock``: one line per missing, extra or differing package."""
    if not res.ok:
        return [f"Python {res.python}: no GPU environment resolves:\n{res.output}"]
    out = []
    for name in sorted(set(res.pins) | set(lock)):
        have, want = res.pins.get(name), lock.get(name)
        if have != want:
            out.append(f"Python {res.python}: {name} resolves to {have or 'nothing'}, the lock "
                       f"{lock_path(res.python).name} has {want or 'nothing'}")
    return out


def check(python: str, pins: list[str] = ()) -> list[str]:
    """Problems of the GPU environment at ``python``: resolved against the index with the lock
    (and ``pins``) as constraints; ``[]`` when it resolves to exactly the lock."""
    path = lock_path(python)
    if not path.is_file():
        return [f"Python {python}: no lock {path.relative_to(ROOT)} (run `make gpu-lock`)"]
    return lock_problems(resolve(python, [path], pins), parse_pins(path.read_text()))


def download_check_wheels(dest: Path, python: str = "3.12") -> int:
    """:data:`CHECK_WHEELS` at the lock's versions and SGLang's ``tensor_bucket.py`` into
    ``dest``; returns the folder's bytes. Raises RuntimeError naming a failed download or the
    size over :data:`WHEELS_MAX_BYTES`."""
    import zipfile

    pins = parse_pins(lock_path(python).read_text())
    want = [f"{n}=={pins[n]}" for n in CHECK_WHEELS] + [f"sglang=={pins['sglang']}"]
    tag = python.replace(".", "")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
               "--python-version", python, "--implementation", "cp", "--abi", f"cp{tag}", "--abi", "abi3",
               "--abi", "none", "-d", tmp]
        for plat in ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "any"):
            cmd += ["--platform", plat]
        p = subprocess.run(cmd + want, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"pip download failed:\n{p.stderr[-3000:]}")
        for whl in Path(tmp).glob("*.whl"):
            if whl.name.startswith("sglang-"):
                with zipfile.ZipFile(whl) as z:
                    (dest / "tensor_bucket.py").write_bytes(z.read("sglang/srt/weight_sync/tensor_bucket.py"))
            else:
                (dest / whl.name).write_bytes(whl.read_bytes())
    total = sum(f.stat().st_size for f in dest.iterdir() if f.is_file())
    if total > WHEELS_MAX_BYTES:
        raise RuntimeError(f"{dest}: {total / 1e6:.1f} MB of wheels, over {WHEELS_MAX_BYTES / 1e6:.0f} MB")
    return total


def check_all(pythons=PYTHONS, pins: list[str] = ()) -> dict[str, list[str]]:
    """:func:`check` for each of ``pythons`` at once (threads; uv does the work)."""
    from concurrent.futures import ThreadPoolExecutor

    uv_bin()
    with ThreadPoolExecutor(len(pythons)) as ex:
        return dict(zip(pythons, ex.map(lambda py: check(py, pins), pythons)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=("lock", "check", "wheels"))
    ap.add_argument("--dest", default=str(ROOT / "shared" / "wheels"), help="wheels: the folder")
    ap.add_argument("--python", action="append", choices=PYTHONS,
                    help="a Python version (repeatable; default: all of " + ", ".join(PYTHONS) + ")")
    ap.add_argument("--pin", action="append", default=[], help="an extra constraint, e.g. transformers==5.23.0")
    args = ap.parse_args(argv)
    if args.action == "wheels":
        total = download_check_wheels(Path(args.dest))
        print(f"{args.dest}: {total / 1e6:.1f} MB; on the GPU machine: "
              f"pip install --no-index --no-deps {args.dest}/*.whl", flush=True)
        return 0
    bad = 0
    pythons = tuple(args.python or PYTHONS)
    checked = check_all(pythons, args.pin) if args.action == "check" else {}
    for py in pythons:
        if args.action == "lock":
            res = resolve(py, [], args.pin, out=lock_path(py))
            print(f"Python {py}: {'wrote ' + lock_path(py).name if res.ok else 'FAILED'} "
                  f"({len(res.pins)} packages)", flush=True)
            problems = [] if res.ok else [res.output]
        else:
            problems = checked[py]
            print(f"Python {py} x86_64: {'resolves to the lock' if not problems else 'FAILED'}", flush=True)
        for p in problems:
            print(p, file=sys.stderr, flush=True)
        bad += bool(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

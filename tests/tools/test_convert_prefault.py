"""convert.prefault_read (one madvise(MADV_POPULATE_READ) over a tensor's pages, used on the
memory-mapped HF safetensors and .distcp items the converters read) leaves data and mapping
as they were; and tools/bench_convert.py takes several families in one run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import pytest
import torch

from moe_async.megatron.hf_io import prefault_read

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _kernel_populates() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (5, 14)


def _mapped(path: str, n: int) -> torch.Tensor:
    return torch.tensor([], dtype=torch.uint8).set_(torch.UntypedStorage.from_file(path, False, n))


def test_prefault_keeps_data_and_copy_on_write(tmp_path):
    n = 64 << 20
    ref = torch.randint(0, 256, (n,), dtype=torch.uint8)
    p = tmp_path / "x.bin"
    p.write_bytes(ref.numpy().tobytes())
    t = _mapped(str(p), n)
    assert prefault_read(t) == _kernel_populates()
    assert zlib.crc32(memoryview(t.numpy())) == zlib.crc32(memoryview(ref.numpy()))
    # the private mapping is still copy-on-write: a write never reaches the file
    t[:16] = 7
    assert p.read_bytes()[:16] == ref[:16].numpy().tobytes()


def test_prefault_of_a_view_and_refusals(tmp_path):
    ref = torch.arange(4096 * 3, dtype=torch.float32)
    p = tmp_path / "y.bin"
    p.write_bytes(ref.numpy().tobytes())
    t = _mapped(str(p), ref.numel() * 4).view(torch.float32)
    v = t[1001:9001]  # starts inside a page: the advice covers from that page's start
    assert prefault_read(v) == _kernel_populates()
    assert torch.equal(v, ref[1001:9001])
    assert prefault_read(torch.empty(0)) is False
    assert prefault_read(t.view(3, 4096)[:, :10]) is False  # not contiguous: nothing done


@pytest.mark.slow  # a benchmark run (two families through tools/bench_convert.py); the conversion itself is tests/tools/test_convert*.py
def test_bench_takes_several_families_in_one_run(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_convert.py"), "--family", "qwen3_moe", "llama",
           "--layers", "2", "--hidden", "64", "--ffn", "64", "--experts", "4", "--vocab", "512", "--repeats", "1",
           "--work", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert [x["family"] for x in lines] == ["qwen3_moe", "llama"]
    for x in lines:
        assert x["round_trip_bit_exact"] is True
        assert len(x["ratios_hf_to_megatron"]) == len(x["ratios_megatron_to_hf"]) == 1
        assert x["ratio_hf_to_megatron"] > 0 and x["ratio_megatron_to_hf"] > 0
        # default page warm-up: a scratch file of 3x the HF bytes; glibc keeps the heap
        assert abs(x["warm_pages_mb"] - 3 * x["hf_gb"] * 1e9 / 2**20) <= 1
        assert x["heap_kept"] is True
    assert not (tmp_path / ".warm_pages").exists()
    # one family, no warm-up, over scratch dirs an interrupted run left behind: runs, table printed
    (tmp_path / "one" / "meg0").mkdir(parents=True)
    (tmp_path / "one" / "meg0" / "left.distcp").write_bytes(b"x")
    one = subprocess.run(cmd[:2] + ["--family", "llama", *cmd[5:-1], str(tmp_path / "one"), "--no-warm-pages"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert one.returncode == 0, one.stderr[-3000:]
    x = json.loads(one.stdout.splitlines()[-1])
    assert x["warm_pages_mb"] == 0 and x["heap_kept"] is False and x["round_trip_bit_exact"] is True
    assert "family        HF->Megatron" in one.stderr
    both = subprocess.run(cmd[:2] + ["--warm-pages-mb", "5", "--no-warm-pages"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    assert "family        HF->Megatron" in r.stderr
    bad = subprocess.run(cmd[:2] + ["--hf", str(tmp_path / "hf_llama"), "--family", "llama", "mixtral"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--hf takes one checkpoint" in bad.stderr


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_warm_pages_leaves_nothing_and_names_its_flags(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from bench_convert import warm_pages

    warm_pages(3 << 20, str(tmp_path))
    assert os.listdir(tmp_path) == []
    with pytest.raises(SystemExit, match=r"could not write 3 MiB into --work .*nope.*--warm-pages-mb.*--no-warm-pages"):
        warm_pages(3 << 20, str(tmp_path / "nope"))

"""The converters refuse bad input up front, naming what is wrong: a TP/PP/EP layout Megatron
cannot build the model at (the flag and the config field, before any process group or
model exists), and a corrupt JSON file (the file). One process, no conversion runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _cli import cli_in_process

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "models"))


@pytest.fixture(scope="module")
def mix(tmp_path_factory) -> str:
    """Tiny Mixtral: 2 layers, 4 heads, 2 KV heads, 4 experts, hidden 64, I 128."""
    from _tiny import make_tiny_mixtral

    return make_tiny_mixtral(str(tmp_path_factory.mktemp("mix") / "hf"), tie=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from _tiny import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("llama") / "hf"))


def test_cli_refuses_ep_not_dividing_experts(mix, tmp_path, capsys, monkeypatch):
    """``--ep 3`` in one process: one error line naming --ep and num_experts, exit status 2,
    no traceback (was Megatron's 'world_size (1) is not divisible by ...' traceback), and
    nothing written."""
    out = tmp_path / "meg"
    rc, err = cli_in_process("convert_hf_to_megatron", ["--hf", mix, "--out", str(out), "--ep", "3"], capsys,
                             monkeypatch)
    assert rc == 2, err
    assert "convert_hf_to_megatron: error:" in err
    assert "--ep 3 does not divide num_experts=4" in err
    assert "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("layout,world,needles", [
    ({"tp": 3}, 3, ["--tp 3 does not divide num_attention_heads=4"]),
    ({"tp": 4}, 4, ["--tp 4 does not divide num_key_value_heads=2"]),
    ({"pp": 3}, 3, ["--pp 3 does not divide num_hidden_layers=2"]),
    ({"ep": 3}, 3, ["--ep 3 does not divide num_experts=4"]),
    ({"ep": 2}, 1, ["world size 1", "--ep x --pp = 2", "torchrun --nproc_per_node"]),
    ({"tp": 2}, 3, ["world size 3", "--tp x --pp = 2"]),
    ({"ep": 0}, 1, ["--ep must be a positive integer"]),
])
def test_layout_refused_naming_flag_and_field(mix, layout, world, needles):
    from moe_async.models import hf_config_dict
    from moe_async.megatron.parallel import check_layout

    lay = {"tp": 1, "pp": 1, "ep": 1, **layout}
    with pytest.raises(ValueError) as ei:
        check_layout(hf_config_dict(mix), lay["tp"], lay["pp"], lay["ep"], world=world)
    for n in needles:
        assert n in str(ei.value), str(ei.value)


@pytest.mark.parametrize("tp,pp,ep,world", [(1, 1, 1, 1), (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2),
                                            (2, 1, 2, 2), (2, 2, 2, 4), (1, 1, 4, 4), (2, 1, 1, 4)])
def test_layout_accepted(mix, tp, pp, ep, world):
    from moe_async.models import hf_config_dict
    from moe_async.megatron.parallel import check_layout

    check_layout(hf_config_dict(mix), tp, pp, ep, world=world)  # no error


def test_dense_model_refuses_ep(llama):
    from moe_async.models import hf_config_dict
    from moe_async.megatron.parallel import check_layout

    with pytest.raises(ValueError, match=r"--ep 2: llama has no experts"):
        check_layout(hf_config_dict(llama), 1, 1, 2, world=2)


@pytest.mark.parametrize("name", ["hf_config.json", "moe_async_convert.json"])
def test_corrupt_json_in_megatron_checkpoint_is_named(mix, tmp_path, name):
    """A corrupt hf_config.json / moe_async_convert.json inside a Megatron checkpoint: a
    ValueError naming the file (was an unnamed JSONDecodeError), before any model exists."""
    from moe_async.megatron.convert import megatron_to_hf_checkpoint

    meg = tmp_path / "meg"
    meg.mkdir()
    with open(mix + "/config.json") as f:
        cfg = json.load(f)
    (meg / "hf_config.json").write_text(json.dumps(cfg))
    (meg / name).write_text('{"model_type": "mixtral", ')  # truncated
    with pytest.raises(ValueError) as ei:
        megatron_to_hf_checkpoint(str(meg), mix, str(tmp_path / "out"), progress=False)
    msg = str(ei.value)
    assert str(meg / name) in msg and "not valid JSON" in msg, msg
    assert not (tmp_path / "out").exists()


def test_corrupt_hf_config_and_index_are_named(mix, tmp_path):
    import shutil

    from moe_async.megatron.convert import hf_to_megatron_checkpoint
    from moe_async.megatron.hf_io import read_hf_index

    bad = tmp_path / "hf"
    shutil.copytree(mix, bad)
    (bad / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"config\.json \(HF config\) is not valid JSON"):
        hf_to_megatron_checkpoint(str(bad), str(tmp_path / "out"), progress=False)
    (bad / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json \(safetensors index\) holds a JSON list"):
        read_hf_index(str(bad))


@pytest.mark.parametrize("fused_first", [True, False])
def test_tensor_in_both_expert_layouts_is_refused(mix, tmp_path, fused_first):
    """Layer 0's experts given fused (transformers' in-memory ``mlp.experts.gate_up_proj`` /
    ``down_proj``) AND one of them again per expert (different values) in another file: refused
    naming that tensor, whichever the index lists first (fused first was accepted and the
    per-expert copy silently dropped)."""
    import torch
    from safetensors.torch import load_file, save_file

    from moe_async.models import get_family
    from moe_async.megatron.hf_io import check_hf_keys, read_hf_config, read_hf_index

    sd = load_file(os.path.join(mix, "model.safetensors"))
    pre, E = "model.layers.0.block_sparse_moe.experts.", 4
    a = {k: v for k, v in sd.items() if not k.startswith(pre)}
    a["model.layers.0.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([sd[f"{pre}{e}.w1.weight"], sd[f"{pre}{e}.w3.weight"]]) for e in range(E)]).contiguous()
    a["model.layers.0.mlp.experts.down_proj"] = torch.stack([sd[f"{pre}{e}.w2.weight"] for e in range(E)]).contiguous()
    dup = f"{pre}0.w1.weight"
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file({dup: torch.zeros_like(sd[dup])}, str(tmp_path / "b.safetensors"))
    keys = sorted(a) + [dup] if fused_first else [dup] + sorted(a)
    wm = {k: ("b.safetensors" if k == dup else "a.safetensors") for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (tmp_path / "config.json").write_text(open(os.path.join(mix, "config.json")).read())
    hf_cfg = read_hf_config(str(tmp_path))
    fam = get_family("mixtral")
    with pytest.raises(ValueError, match=f"gives '{dup}' in both the fused and the per-expert layout"):
        check_hf_keys(fam, fam.arch_args(hf_cfg), read_hf_index(str(tmp_path)))


def _cli(tool: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), *args, "--no-progress"],
                          capture_output=True, text=True, timeout=300, env=env)


def test_cli_out_is_a_file_is_named(mix, tmp_path):
    """``--out`` naming an existing FILE: one error line naming --out and the path, exit 2,
    no traceback (was NotADirectoryError from os.listdir after the model was read), file untouched."""
    out = tmp_path / "taken"
    out.write_text("not a dir")
    p = _cli("convert_hf_to_megatron.py", "--hf", mix, "--out", str(out))
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-4000:])
    assert "Traceback" not in p.stderr
    assert f"convert_hf_to_megatron: error: --out {out} is an existing file, not a directory" in p.stderr
    assert out.read_text() == "not a dir"


def test_out_is_a_file_or_under_one_megatron_to_hf(mix, tmp_path):
    """The same for convert_megatron_to_hf (checked before the checkpoint is even looked at),
    and an --out below a file."""
    from moe_async.megatron.tool_args import check_out_dir
    from moe_async.megatron.convert import megatron_to_hf_checkpoint

    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(FileExistsError, match=rf"--out {f} is an existing file, not a directory"):
        megatron_to_hf_checkpoint(str(tmp_path / "no_ckpt"), mix, str(f), progress=False)
    with pytest.raises(FileExistsError, match=rf"--out {f}/sub/dir cannot be created: {f} is a file"):
        check_out_dir(str(f / "sub" / "dir"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a").write_text("")
    with pytest.raises(FileExistsError, match=r"--out .*full exists and is not empty"):
        check_out_dir(str(tmp_path / "full"))
    check_out_dir(str(tmp_path / "new" / "dir"))  # absent below a dir: fine


@pytest.fixture(scope="module")
def meg(mix, tmp_path_factory) -> str:
    """The tiny Mixtral as a torch_dist checkpoint (1 process, in this process)."""
    from moe_async.megatron.convert import hf_to_megatron_checkpoint

    out = str(tmp_path_factory.mktemp("meg") / "meg")
    hf_to_megatron_checkpoint(mix, out, progress=False)
    return out


def _truncate(path, keep: float = 0.5) -> None:
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: int(len(data) * keep)])


@pytest.mark.parametrize("name,needle", [
    ("__0_0.distcp", "(torch_dist data) is truncated"),
    ("common.pt", "(torch_dist common state) cannot be read, truncated or corrupt"),
    (".metadata", "(torch_dist metadata) cannot be read, truncated or corrupt"),
    ("metadata.json", "(Megatron checkpoint metadata) is not valid JSON"),
])
def test_truncated_checkpoint_file_is_named(mix, meg, tmp_path, name, needle):
    """A truncated file of the input torch_dist checkpoint: a ValueError naming that file
    (were: an unnamed zip/pickle/JSON error, or DCP's CheckpointException with a traceback
    per rank), nothing written."""
    import shutil

    from moe_async.megatron.convert import megatron_to_hf_checkpoint

    root = tmp_path / "meg"
    shutil.copytree(meg, root)
    bad = root / "iter_0000000"  # Megatron-LM's container: the torch_dist files are in the iteration dir
    assert (bad / name).exists(), sorted(os.listdir(bad))
    _truncate(bad / name)
    with pytest.raises(ValueError) as ei:
        megatron_to_hf_checkpoint(str(root), mix, str(tmp_path / "out"), progress=False)
    msg = str(ei.value)
    assert f"{bad / name} {needle}" in msg, msg
    assert not (tmp_path / "out").exists()


def test_corrupt_distcp_item_is_named(mix, meg, tmp_path):
    """A .distcp of the right length whose bytes are garbage: the file and the item's offset
    are named (the zip reader's own error says neither)."""
    import shutil

    from moe_async.megatron.convert import megatron_to_hf_checkpoint

    bad = tmp_path / "meg"
    shutil.copytree(meg, bad)
    p = bad / "iter_0000000" / "__0_0.distcp"
    n = os.path.getsize(p)
    with open(p, "wb") as f:
        f.write(b"\x07" * n)
    with pytest.raises(ValueError, match=rf"{p} \(torch_dist data\): the item at byte \d+ .* cannot be read"):
        megatron_to_hf_checkpoint(str(bad), mix, str(tmp_path / "out"), progress=False)


def test_truncated_distcp_cli_one_line(mix, meg, tmp_path):
    """Through the CLI: one ``error:`` line naming the file, exit 2, no traceback."""
    import shutil

    bad = tmp_path / "meg"
    shutil.copytree(meg, bad)
    shard = bad / "iter_0000000" / "__0_0.distcp"
    _truncate(shard, 0.3)
    p = _cli("convert_megatron_to_hf.py", "--megatron", str(bad), "--hf-config", mix, "--out", str(tmp_path / "o"))
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-4000:])
    assert "Traceback" not in p.stderr, p.stderr[-4000:]
    assert f"convert_megatron_to_hf: error: {shard} (torch_dist data) is truncated" in p.stderr


def test_truncated_hf_safetensors_is_named(mix, tmp_path, capsys, monkeypatch):
    """A truncated HF ``.safetensors`` input: one error line naming the file, exit 2 (was a
    SafetensorError traceback, exit 1); the same check guards the trainer's HF load."""
    import shutil

    from moe_async.errors import CheckpointReadError, check_safetensors_file

    hf = tmp_path / "hf"
    shutil.copytree(mix, hf)
    (st,) = sorted(hf.glob("*.safetensors"))
    check_safetensors_file(str(st))  # intact
    data = st.read_bytes()
    st.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointReadError, match=f"cannot read safetensors file {st}: truncated"):
        check_safetensors_file(str(st))
    st.write_bytes(data[:6])
    with pytest.raises(CheckpointReadError, match="shorter than the 8-byte header length"):
        check_safetensors_file(str(st))
    st.write_bytes(data[:200])
    rc, err = cli_in_process("convert_hf_to_megatron", ["--hf", str(hf), "--out", str(tmp_path / "out")], capsys,
                             monkeypatch)
    assert rc == 2, err
    assert "Traceback" not in err
    assert f"convert_hf_to_megatron: error: cannot read safetensors file {st}" in err


@pytest.mark.parametrize("size", ["0", "0MB", "lots"])
def test_max_shard_size_must_be_positive(size, tmp_path):
    p = _cli("convert_megatron_to_hf.py", "--megatron", str(tmp_path), "--hf-config", str(tmp_path),
             "--out", str(tmp_path / "o"), "--max-shard-size", size)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"--max-shard-size {size!r}: expected a positive size" in p.stderr


def test_shard_writer_files_get_the_umask_mode(tmp_path):
    """safetensors creates its files 0600; the converter's HF output gets 0666 less the umask,
    like the index written next to it (other users of a shared machine can read the weights)."""
    import stat

    import torch

    from moe_async.megatron.export import ShardWriter

    old = os.umask(0o022)
    try:
        w = ShardWriter(str(tmp_path), 64)
        w.add("a", torch.zeros(16))
        w.add("b", torch.ones(16))
        names = w.close()
    finally:
        os.umask(old)
    assert len(names) == 2
    for fn in [*names, "model.safetensors.index.json"]:
        assert stat.S_IMODE(os.stat(tmp_path / fn).st_mode) == 0o644, fn

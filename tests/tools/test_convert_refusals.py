"""The converters refuse bad input up front, naming what is wrong: a TP/PP/EP layout Megatron
cannot build the model at (the flag and the config field, before any process group or
model exists), and a corrupt JSON file (the file). One process, no conversion runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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


def test_cli_refuses_ep_not_dividing_experts(mix, tmp_path):
    """``--ep 3`` in one process: one error line naming --ep and num_experts, exit status 2,
    no traceback (was Megatron's 'world_size (1) is not divisible by ...' traceback), and
    nothing written."""
    out = tmp_path / "meg"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_hf_to_megatron.py"), "--hf", mix,
                        "--out", str(out), "--ep", "3", "--no-progress"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-4000:])
    assert "convert_hf_to_megatron: error:" in p.stderr
    assert "--ep 3 does not divide num_experts=4" in p.stderr
    assert "Traceback" not in p.stderr
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
    from moe_async.models.convert import check_layout

    lay = {"tp": 1, "pp": 1, "ep": 1, **layout}
    with pytest.raises(ValueError) as ei:
        check_layout(hf_config_dict(mix), lay["tp"], lay["pp"], lay["ep"], world=world)
    for n in needles:
        assert n in str(ei.value), str(ei.value)


@pytest.mark.parametrize("tp,pp,ep,world", [(1, 1, 1, 1), (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2),
                                            (2, 1, 2, 2), (2, 2, 2, 4), (1, 1, 4, 4), (2, 1, 1, 4)])
def test_layout_accepted(mix, tp, pp, ep, world):
    from moe_async.models import hf_config_dict
    from moe_async.models.convert import check_layout

    check_layout(hf_config_dict(mix), tp, pp, ep, world=world)  # no error


def test_dense_model_refuses_ep(llama):
    from moe_async.models import hf_config_dict
    from moe_async.models.convert import check_layout

    with pytest.raises(ValueError, match=r"--ep 2: llama has no experts"):
        check_layout(hf_config_dict(llama), 1, 1, 2, world=2)


@pytest.mark.parametrize("name", ["hf_config.json", "moe_async_convert.json"])
def test_corrupt_json_in_megatron_checkpoint_is_named(mix, tmp_path, name):
    """A corrupt hf_config.json / moe_async_convert.json inside a Megatron checkpoint: a
    ValueError naming the file (was an unnamed JSONDecodeError), before any model exists."""
    from moe_async.models.convert import megatron_to_hf_checkpoint

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

    from moe_async.models.convert import hf_to_megatron_checkpoint, read_hf_index

    bad = tmp_path / "hf"
    shutil.copytree(mix, bad)
    (bad / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"config\.json \(HF config\) is not valid JSON"):
        hf_to_megatron_checkpoint(str(bad), str(tmp_path / "out"), progress=False)
    (bad / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json \(safetensors index\) holds a JSON list"):
        read_hf_index(str(bad))

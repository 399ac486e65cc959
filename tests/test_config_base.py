"""Config composition: ``base:`` files deep-merged under a config, overrides winning; errors
name the file."""

from pathlib import Path

import pytest

from moe_async.cli import main
from moe_async.config import ConfigError, deep_merge, load_config, read_config_tree


def _w(p: Path, text: str) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_deep_merge_maps_merge_other_values_replace():
    base = {"a": {"x": 1, "y": [1, 2], "z": {"k": 1}}, "b": 1}
    over = {"a": {"y": [3], "z": {"j": 2}}, "c": None}
    assert deep_merge(base, over) == {"a": {"x": 1, "y": [3], "z": {"k": 1, "j": 2}}, "b": 1, "c": None}
    assert base == {"a": {"x": 1, "y": [1, 2], "z": {"k": 1}}, "b": 1}  # inputs untouched


def test_bases_merge_in_order_file_then_overrides_win(tmp_path):
    _w(tmp_path / "base" / "one.yaml", "trainer: {lr: 1.0e-5, micro_batch_size: 2}\nrollout: {max_new_tokens: 16}\n")
    _w(tmp_path / "base" / "two.yaml", "trainer: {lr: 2.0e-5}\nengine: {max_running_requests: 8}\n")
    top = _w(tmp_path / "exp" / "run.yaml",
             "base: [../base/one.yaml, ../base/two.yaml]\ntrainer: {micro_batch_size: 3}\nnum_steps: 2\n")
    cfg = load_config(top)
    assert cfg.trainer.lr == 2.0e-5            # the later base wins over the earlier
    assert cfg.trainer.micro_batch_size == 3   # the file wins over its bases
    assert cfg.rollout.max_new_tokens == 16 and cfg.engine.max_running_requests == 8 and cfg.num_steps == 2
    cfg = load_config(top, ["trainer.micro_batch_size=5", "trainer.lr=3e-5"])
    assert (cfg.trainer.micro_batch_size, cfg.trainer.lr) == (5, 3e-5)  # overrides win over everything


def test_bases_resolve_relative_to_the_naming_file_and_nest(tmp_path, monkeypatch):
    _w(tmp_path / "a" / "root.yaml", "rollout: {max_new_tokens: 12, temperature: 0.5}\n")
    _w(tmp_path / "a" / "mid.yaml", "base: root.yaml\nrollout: {max_new_tokens: 24}\n")
    top = _w(tmp_path / "top.yaml", "base: a/mid.yaml\n")
    monkeypatch.chdir(tmp_path / "a")  # not the cwd: each base is relative to the file naming it
    data, files = read_config_tree(top)
    assert data == {"rollout": {"max_new_tokens": 24, "temperature": 0.5}}
    assert [f.name for f in files] == ["root.yaml", "mid.yaml", "top.yaml"]


@pytest.mark.parametrize(
    "top, extra, needle",
    [
        ("base: missing.yaml\n", {}, r"top\.yaml: base 'missing\.yaml' not found"),
        ("base: 3\n", {}, r"top\.yaml: base must be a file path or a non-empty list"),
        ("base: []\n", {}, r"top\.yaml: base must be"),
        ("base: b.yaml\n", {"b.yaml": "base: top.yaml\n"}, r"b\.yaml: base 'top\.yaml' makes a cycle: .*top\.yaml -> .*b\.yaml -> .*top\.yaml"),
        ("base: b.yaml\n", {"b.yaml": "trainer: [1,\n"}, r"b\.yaml: YAML error"),
        ("base: b.yaml\n", {"b.yaml": "trainer: {lr: 1}\ntrainer: {lr: 2}\n"}, r"b\.yaml: duplicate key 'trainer'"),
    ],
)
def test_bad_bases_name_the_file(tmp_path, top, extra, needle):
    for name, text in extra.items():
        _w(tmp_path / name, text)
    with pytest.raises(ConfigError, match=needle):
        load_config(_w(tmp_path / "top.yaml", top))


def test_a_bad_field_from_a_base_names_the_bases_and_the_field(tmp_path, capsys):
    _w(tmp_path / "b.yaml", "trainer: {lrr: 1.0}\n")
    top = _w(tmp_path / "top.yaml", "base: b.yaml\n")
    assert main(["show-config", str(top)]) == 2
    err = capsys.readouterr().err
    assert "top.yaml (with base " in err and "b.yaml" in err and "trainer.lrr: unknown key" in err


def test_show_config_prints_the_merged_config_without_base(tmp_path, capsys):
    _w(tmp_path / "b.yaml", "rollout: {max_new_tokens: 40}\n")
    top = _w(tmp_path / "top.yaml", "base: b.yaml\nname: merged\n")
    assert main(["show-config", str(top)]) == 0
    out = capsys.readouterr().out
    assert "base:" not in out and "max_new_tokens: 40" in out and "name: merged" in out
    dumped = _w(tmp_path / "dumped.yaml", out)
    assert load_config(dumped) == load_config(top)

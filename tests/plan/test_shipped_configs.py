"""Every shipped real-model config validates with ``show-config``, round-trips, and plans with
``plan`` (exit 0, a table per role); their parameter counts match the published totals."""

from pathlib import Path

import pytest

from moe_async.cli import main
from moe_async.config import dump_config, load_config
from moe_async.plan.report import make_plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
REAL = sorted(p.name for p in CONFIGS.glob("*.yaml") if load_config(p).model.arch is not None)

# Published totals (model cards), B parameters: total, active per token, and the tolerance.
# DeepSeek-V3's 671B excludes its 14B MTP module; GLM-4.5-Air's 12B active excludes embeddings
# (13.4B with them, as counted here).
PUBLISHED = {
    "qwen3_30b_a3b.yaml": (30.5, 3.3),
    "qwen3_235b_a22b.yaml": (235, 22),
    "deepseek_v3.yaml": (671, 37),
    "mixtral_8x7b.yaml": (46.7, 12.9),
    "glm45_air.yaml": (106, 12),
}


def test_the_five_real_model_configs_are_shipped():
    assert REAL == sorted(PUBLISHED)


@pytest.mark.parametrize("name", REAL)
def test_show_config_and_round_trip(name, tmp_path, capsys):
    assert main(["show-config", str(CONFIGS / name)]) == 0
    out = capsys.readouterr().out
    cfg = load_config(CONFIGS / name)
    assert cfg.engine.backend == "sglang" and cfg.model.source == "hf" and cfg.model.hf_path
    assert cfg.trainer.off_policy_correction != "none" and cfg.async_.max_staleness >= 1
    assert cfg.trainer.router_replay == "R3" and cfg.rollout.return_routed_experts
    (tmp_path / "c.yaml").write_text(out)
    assert load_config(tmp_path / "c.yaml") == cfg == load_config(tmp_path / "c.yaml") and dump_config(cfg) == out


@pytest.mark.parametrize("name", REAL)
def test_plan_prints_a_table_per_role_and_fits(name, capsys):
    assert main(["plan", str(CONFIGS / name)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    for row in ("trainer  ", "optimizer on every rank", "distributed (dense /", "offloaded to CPU",
                "<- configured", "engine   ", "KV pool", "weight sync", "lower bound"):
        assert row in out, row
    assert "DOES NOT FIT" not in out


@pytest.mark.parametrize("name", REAL)
def test_parameter_totals_match_published(name):
    total, active = PUBLISHED[name]
    s = make_plan(load_config(CONFIGS / name), family_check=False).shape
    assert s.total / 1e9 == pytest.approx(total, rel=0.01)
    emb = (s.embedding + s.output) / 1e9 if name == "glm45_air.yaml" else 0
    assert s.active / 1e9 - emb == pytest.approx(active, rel=0.03)

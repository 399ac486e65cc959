"""`moe-async plan` prints the model's RoPE: the shipped DeepSeek-V3 config's released YaRN
(factor 40, softmax x1.874), plain RoPE for a config without scaling, and the reason for one no
family implements."""

from __future__ import annotations

import os

from moe_async.plan.arch import rope_row

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def test_deepseek_v3_plan_prints_the_released_yarn(capsys):
    from moe_async.cli import main

    assert main(["plan", os.path.join(ROOT, "configs", "deepseek_v3.yaml")]) in (0, None)
    out = capsys.readouterr().out
    row = [ln for ln in out.splitlines() if ln.startswith("rope ")]
    assert row == ["rope     yarn (theta 10000, factor 40 over 4096 positions, beta 32/1, cos/sin x1, softmax x1.874)"]


def test_rope_rows():
    assert rope_row({"rope_theta": 1e6}) == "rope (theta 1e+06)"
    assert rope_row({}) == "rope (rope_theta not given)"
    row = rope_row({"rope_theta": 1e4, "rope_scaling": {"type": "longrope", "factor": 4}})
    assert row.startswith("not supported: ") and "rope_scaling.rope_type='longrope'" in row

"""tools/bench_data.py: its generated rows are valid slime rows whose labels are the sums and
score 1.0 under their data_source's reward; a tiny run prints every figure (`pytest -m slow`)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_data", ROOT / "tools/bench_data.py")
bench_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_data)


def test_generated_rows_pass_the_start_up_check_and_score(tmp_path):
    import re

    from moe_async.data.check import check_data
    from moe_async.data.config import DataConfig
    from moe_async.data.dataset import FileDataset
    from moe_async.rollout.row_rewards import RowReward

    p = tmp_path / "p.jsonl"
    bench_data.generate(p, 40)
    lines = [json.loads(x) for x in p.read_text().splitlines()]
    assert len(lines) == 40 and [r["metadata"]["id"] for r in lines] == list(range(40))
    for r in lines:
        a, b = map(int, re.findall(r"\d+", r["prompt"])[:2])
        assert r["label"] == str(a + b)
    data = DataConfig(train=str(p), default_reward="math_verify", cache_dir=str(tmp_path / "cache"))
    assert check_data(data) == {"train_rows": 40, "eval_rows": {}, "data_sources": {"math": "math_verify"}}
    row = FileDataset(data).row(5)
    assert RowReward(data.rewards, data.default_reward)(row, f"so \\boxed{{{lines[5]['label']}}}") == 1.0


# `pytest -m slow` only: three fresh processes (imports, tokenizer); the rows it measures are
# proven valid by test_generated_rows_pass_the_start_up_check_and_score above
@pytest.mark.slow
def test_tiny_run_prints_every_figure(tmp_path, capsys):
    assert bench_data.main(["--rows", "300", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for text in ("300 rows", "moe-async cold:", "moe-async warm:", "reference (json.loads", "goals (< 30 s"):
        assert text in out, out
    res = json.loads(out.strip().splitlines()[-1])
    assert res["rows"] == 300 and res["cold"]["rows"] == res["warm"]["rows"] == res["reference"]["rows"] == 300
    assert res["cold"]["prompt_tokens"] > 0 and res["cold"]["config_bytes_to_actors"] < 4096

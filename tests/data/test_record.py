"""trained_rows.jsonl: each trained group's row, draw and the row's own data_source."""

import json

from moe_async.data.record import record_trained
from moe_async.types import Group, Sample


def _group(meta):
    s = Sample(prompt_ids=[1, 2], response_ids=[3], rollout_logprobs=[-0.5], weight_versions=[0], metadata=meta)
    return Group(group_id=0, samples=[s], start_version=0)


def test_rows_without_a_data_source_are_recorded_as_default_not_the_task(tmp_path):
    """A row with no data_source is scored by data.default_reward and labelled 'default' in
    metrics; its record must say the same (it used to carry rollout.task's name)."""
    record_trained(tmp_path, 3, [_group({"task": "basic_arithmetic", "data_source": "default", "problem_index": 51,
                                         "draw_seq": 7}),
                                 _group({"task": "openai/gsm8k", "data_source": "openai/gsm8k", "problem_index": 2,
                                         "draw_seq": 8})])
    rows = [json.loads(x) for x in (tmp_path / "trained_rows.jsonl").read_text().splitlines()]
    assert [(r["step"], r["draw"], r["row"], r["data_source"], r["prompt_ids"]) for r in rows] == [
        (3, 7, 51, "default", [1, 2]), (3, 8, 2, "openai/gsm8k", [1, 2])]


def test_records_name_the_file_and_its_row(tmp_path):
    """``row`` counts over all train files; ``file`` / ``file_row`` say which file and where."""
    record_trained(tmp_path, 1, [_group({"data_source": "a", "problem_index": 7, "draw_seq": 0,
                                         "file": "/d/b.jsonl", "file_row": 2})])
    (r,) = [json.loads(x) for x in (tmp_path / "trained_rows.jsonl").read_text().splitlines()]
    assert (r["row"], r["file"], r["file_row"]) == (7, "/d/b.jsonl", 2)

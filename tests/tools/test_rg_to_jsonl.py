"""tools/rg_to_jsonl.py: a reasoning-gym task written as slime JSONL trains on the same prompt
token ids as the generator, its eval files hold the generator's held-out problems (disjoint
from train and from each other), and each row is scored by the task's own scorer."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("rg_to_jsonl", ROOT / "tools/rg_to_jsonl.py")
rg_to_jsonl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rg_to_jsonl)


def test_file_rows_equal_the_generators_prompts_answers_and_scores(tmp_path):
    from moe_async.data.check import check_data
    from moe_async.data.config import DataConfig
    from moe_async.data.dataset import FileDataset
    from moe_async.models.prepare import load_smollm2_tokenizer
    from moe_async.rollout.config import RolloutConfig
    from moe_async.rollout.row_rewards import RowReward
    from moe_async.rollout.tasks import TaskDataset

    train, ea, eb = tmp_path / "t.jsonl", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert rg_to_jsonl.main(["--task", "basic_arithmetic", "--train-size", "12", "--train", str(train),
                             "--eval", f"{ea}:3", "--eval", f"{eb}:2"]) == 0
    tok = load_smollm2_tokenizer()
    gen = TaskDataset(RolloutConfig(task="basic_arithmetic", train_size=12, eval_size=5), tok)
    data = DataConfig(train=str(train), eval={"a": {"path": str(ea)}, "b": {"path": str(eb)}})
    assert check_data(data)["data_sources"] == {"basic_arithmetic": "reasoning_gym"}  # by data_source
    ds = FileDataset(data, tok)
    assert ds.n == 12
    for i in (0, 7, 11):  # the engines get the generator's prompt token ids; the label is its answer
        assert ds.build_prompt_ids(ds.row(i)) == gen.build_prompt_ids(gen.train[i])
        assert ds.row(i).answer == gen.train[i].answer
    held = ds.eval_sets["a"] + ds.eval_sets["b"]
    assert [r.answer for r in held] == [p.answer for p in gen.eval]  # the generator's held-out 5, in order
    assert [ds.build_prompt_ids(r) for r in held] == [gen.build_prompt_ids(p) for p in gen.eval]
    train_q = {ds.row(i).question for i in range(12)}
    assert not train_q & {r.question for r in held} and len({r.question for r in held}) == 5
    score = RowReward(data.rewards, data.default_reward)
    for p, r in zip(gen.eval, held):  # the task's reasoning-gym scorer through data_source
        right, wrong = f"The answer is {p.answer}.", f"The answer is {p.answer}1."
        assert (score(r, right), score(r, wrong)) == (gen.score(p, right), gen.score(p, wrong)) == (1.0, 0.0)


def test_bad_arguments_and_unknown_task_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        rg_to_jsonl.main(["--train", str(tmp_path / "t.jsonl"), "--eval", "no_count"])
    assert "--eval 'no_count': expected PATH:N" in capsys.readouterr().err
    assert rg_to_jsonl.main(["--task", "no_such_task", "--train", str(tmp_path / "t.jsonl")]) == 2
    assert "rollout.task='no_such_task' is not a reasoning-gym dataset" in capsys.readouterr().err
    assert not (tmp_path / "t.jsonl").exists()

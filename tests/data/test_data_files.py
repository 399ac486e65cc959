"""Prompt files: formats read unchanged, chat templating, epoch order and resume, and every bad
input refused at start-up naming the file, the row (JSONL line) and the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_async.data.check import check_data
from moe_async.data.config import DataConfig
from moe_async.data.dataset import FileDataset
from moe_async.data.source import DataError
from tests.data._fixtures import SYSTEM, slime_rows, verl_rows, write_jsonl, write_parquet


@pytest.fixture(scope="module")
def tok():
    from moe_async.models.prepare import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


def _template(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_verl_parquet_slime_jsonl_and_messages_rows_and_prompt_ids(tmp_path, tok) -> None:
    pq = write_parquet(tmp_path / "verl.parquet", verl_rows(5))
    js = write_jsonl(tmp_path / "slime.jsonl", slime_rows(4))
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "system", "content": SYSTEM},
                                                     {"role": "user", "content": f"{i} - 1?"},
                                                     {"role": "assistant", "content": str(i - 1)}]}) + "\n"
                            for i in range(3)))
    data = DataConfig(train=[str(pq), str(js)], system_prompt="Be brief.", default_reward="exact_match",
                      eval={"chat": {"path": str(chat)}})
    info = check_data(data)
    assert info["train_rows"] == 9 and info["eval_rows"] == {"chat": 3}
    assert info["data_sources"] == {"src_a": "exact_match", "src_b": "exact_match", None: "exact_match"}
    ds = FileDataset(data, tok)
    r = ds.row(2)  # verl: prompt messages as given (it has a system message), ground truth, extra_info
    assert (r.data_source, r.answer, r.extra_info["index"]) == ("src_a", "4", 2)
    assert ds.build_prompt_ids(r) == _template(tok, verl_rows(5)[2]["prompt"])
    assert (r.file, r.file_row) == (str(pq), 2)
    r = ds.row(5 + 3)  # slime string prompt: data.system_prompt first, then the user message
    assert (r.data_source, r.answer, r.metadata["id"]) == ("src_b", "9", 3)
    assert (r.file, r.file_row) == (str(js), 3)  # trained_rows.jsonl's file and file_row
    assert ds.build_prompt_ids(r) == _template(tok, [{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "Compute 3 * 3."}])
    e = ds.eval_sets["chat"][1]  # messages: the trailing assistant message is the label, not prompt
    assert e.answer == "0" and [m["role"] for m in e.prompt] == ["system", "user"]
    assert ds.build_prompt_ids(e) == _template(tok, e.prompt)


def test_rollout_system_prompt_goes_to_string_prompts_only(tmp_path, tok) -> None:
    """Without ``data.system_prompt`` a string prompt gets the run's ``rollout.system_prompt``
    and a message list without a system message is templated exactly as given (the tokenizer's
    own default system prompt, not ours); ``data.system_prompt`` goes first in both."""
    msgs = [{"role": "user", "content": "7 - 2?"}]
    js = [str(write_jsonl(tmp_path / "s.jsonl", [{"prompt": "3 + 4?", "label": "7"}])),
          str(write_jsonl(tmp_path / "m.jsonl", [{"prompt": msgs, "label": "5"}]))]
    ds = FileDataset(DataConfig(train=js, default_reward="exact_match"), tok, system_prompt="Run's.")
    assert ds.build_prompt_ids(ds.row(0)) == _template(tok, [{"role": "system", "content": "Run's."},
                                                             {"role": "user", "content": "3 + 4?"}])
    assert ds.build_prompt_ids(ds.row(1)) == _template(tok, msgs)
    ds = FileDataset(DataConfig(train=js, default_reward="exact_match", system_prompt="Data's."), tok,
                     system_prompt="Run's.")
    assert ds.build_prompt_ids(ds.row(1)) == _template(tok, [{"role": "system", "content": "Data's."}, *msgs])


def test_slime_keys_renamed_and_no_chat_template(tmp_path, tok) -> None:
    js = write_jsonl(tmp_path / "s.jsonl", [{"question": "2+2=", "answer": "4"}])
    data = DataConfig(train=str(js), input_key="question", label_key="answer", apply_chat_template=False,
                      default_reward="exact_match")
    check_data(data)
    ds = FileDataset(data, tok)
    assert ds.build_prompt_ids(ds.row(0)) == tok("2+2=", add_special_tokens=False)["input_ids"]


def test_epochs_are_seeded_permutations_and_seek_resumes_the_same_rows(tmp_path) -> None:
    js = write_jsonl(tmp_path / "s.jsonl", slime_rows(7))
    data = DataConfig(train=str(js), default_reward="exact_match", seed=3)
    a = FileDataset(data)
    draws = [a.next_train().index for _ in range(21)]
    for e in range(3):  # every epoch draws every row exactly once
        assert sorted(draws[7 * e:7 * e + 7]) == list(range(7))
    assert draws[:7] != draws[7:14]  # reshuffled per epoch
    b = FileDataset(data)
    b.seek(10)
    assert b.position() == 10 and [b.next_train().index for _ in range(11)] == draws[10:]
    c = FileDataset(DataConfig(train=str(js), default_reward="exact_match", shuffle=False))
    assert [c.next_train().index for _ in range(7)] == list(range(7))


def _refused(data: DataConfig, *parts: str) -> str:
    with pytest.raises(DataError) as e:
        check_data(data)
    msg = str(e.value)
    for p in parts:
        assert p in msg, msg
    return msg


def test_missing_and_empty_files_refused(tmp_path) -> None:
    _refused(DataConfig(train=str(tmp_path / "nope.jsonl")), "data.train", "nope.jsonl", "no such file")
    (tmp_path / "empty.jsonl").write_text("")
    _refused(DataConfig(train=str(tmp_path / "empty.jsonl")), "data.train", "empty.jsonl", "empty")
    ok = write_jsonl(tmp_path / "ok.jsonl", slime_rows(2))
    _refused(DataConfig(train=str(ok), default_reward="exact_match", eval={"held": {"path": str(tmp_path / "x.parquet")}}),
             "data.eval.held", "x.parquet", "no such file")


def test_malformed_json_line_names_the_line(tmp_path) -> None:
    p = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in slime_rows(4)]
    lines[2] = lines[2][:-1]  # line 3 loses its closing brace
    p.write_text("\n".join(lines) + "\n")
    _refused(DataConfig(train=str(p), default_reward="exact_match"), "data.train", "bad.jsonl", "line 3",
             "malformed JSON")


def test_missing_prompt_or_label_key_names_row_and_key(tmp_path) -> None:
    rows = slime_rows(5)
    del rows[3]["prompt"]
    p = tmp_path / "noprompt.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _refused(DataConfig(train=str(p), default_reward="exact_match"), "noprompt.jsonl", "row 3 (line 4)",
             "missing key 'prompt' (data.input_key names the prompt's key)")
    rows = slime_rows(5)
    del rows[1]["label"]
    p = tmp_path / "nolabel.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _refused(DataConfig(train=str(p), default_reward="exact_match"), "nolabel.jsonl", "row 1 (line 2)",
             "missing key 'label' (data.label_key names the label's key)")
    p = write_jsonl(tmp_path / "renamed.jsonl", [{"q": "x", "a": "1"}])
    _refused(DataConfig(train=str(p), input_key="q", default_reward="exact_match"), "renamed.jsonl",
             "missing key 'label'", "data.label_key")
    rows = verl_rows(3)
    rows[2]["reward_model"] = {"style": "rule", "ground_truth": None}
    p = write_parquet(tmp_path / "v.parquet", rows)
    _refused(DataConfig(train=str(p), default_reward="exact_match"), "v.parquet", "row 2",
             "reward_model.ground_truth")


def test_prompt_of_wrong_type_names_row_and_key(tmp_path) -> None:
    rows = slime_rows(4)
    rows[2]["prompt"] = 17
    p = tmp_path / "mixed.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _refused(DataConfig(train=str(p), default_reward="exact_match"), "mixed.jsonl", "row 2 (line 3)", "'prompt'",
             "int")
    p = write_jsonl(tmp_path / "numbers.jsonl", [{"prompt": 1.5, "label": "x"}])
    _refused(DataConfig(train=str(p), default_reward="exact_match"), "numbers.jsonl", "row 0", "'prompt'")
    p = write_jsonl(tmp_path / "norole.jsonl", [{"prompt": [{"text": "hi"}], "label": "x"}])
    _refused(DataConfig(train=str(p), default_reward="exact_match"), "norole.jsonl", "row 0", "'prompt'")


def test_bad_messages_name_row_and_key(tmp_path) -> None:
    """A message whose content is null, a role no chat template knows, an empty message list:
    refused at start-up naming the row (before, a null content passed and the run died later in
    the rollout loop with an unnamed TypeError, and a 'robot' role was trained on)."""
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    rows = [{"prompt": msgs, "label": "4"} for _ in range(5)]
    rows[3] = {"prompt": [{"role": "user", "content": None}], "label": "4"}
    p = write_jsonl(tmp_path / "null.jsonl", rows)
    _refused(DataConfig(train=str(p), default_reward="exact_match"), "null.jsonl", "row 3 (line 4)",
             "'prompt'", "'content' is null")
    rows[3] = {"prompt": [{"role": "system", "content": "x"}, {"role": "robot", "content": "hi"}], "label": "4"}
    p = write_jsonl(tmp_path / "robot.jsonl", rows)
    _refused(DataConfig(train=str(p), default_reward="exact_match"), "robot.jsonl", "row 3 (line 4)",
             "role 'robot' is not one of")
    rows[3] = {"prompt": [], "label": "4"}
    p = write_parquet(tmp_path / "empty_list.parquet", rows)
    _refused(DataConfig(train=str(p), default_reward="exact_match"), "empty_list.parquet", "row 3",
             "empty message list")


def test_unknown_data_source_without_default_reward(tmp_path) -> None:
    p = write_jsonl(tmp_path / "s.jsonl", slime_rows(3, source="my_set"))
    _refused(DataConfig(train=str(p)), "data.train", "s.jsonl", "row 0", "data_source 'my_set' has no reward",
             "data.default_reward")
    rows = slime_rows(3) + slime_rows(2, source="openai/gsm8k")  # known sources have built-in rewards
    p = write_jsonl(tmp_path / "mixed_sources.jsonl", rows)
    assert check_data(DataConfig(train=str(p), rewards={"src_b": "math_verify"}))["data_sources"] == {
        "src_b": "math_verify", "openai/gsm8k": "gsm8k"}


def test_bad_data_refused_by_train_before_any_process(tmp_path) -> None:
    from moe_async.config import load_config
    from moe_async.errors import UserInputError
    from moe_async.orchestration.driver import run_experiment

    out = tmp_path / "runs"
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs/cpu_smoke.yaml", [f"data.train={tmp_path / 'missing.jsonl'}",
                                                        f"logging.output_dir={out}"])
    with pytest.raises(UserInputError, match="missing.jsonl"):
        run_experiment(cfg)
    assert not out.exists()  # before the run dir, the model, Ray or any engine


def test_relative_paths_resolved_at_config_load(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    d = DataConfig(train="a.jsonl", eval={"e": {"path": "b.parquet"}}, rewards={"s": "verl:r.py:f"})
    assert d.train == str(tmp_path / "a.jsonl") and d.eval["e"].path == str(tmp_path / "b.parquet")
    assert d.rewards["s"] == f"verl:{tmp_path / 'r.py'}:f"


def test_folder_of_files_and_save_to_disk_folder(tmp_path) -> None:
    import datasets

    folder = tmp_path / "shards"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", slime_rows(3))
    write_jsonl(folder / "b.jsonl", slime_rows(2))
    disk = tmp_path / "saved"
    datasets.Dataset.from_list(verl_rows(4)).save_to_disk(str(disk))
    data = DataConfig(train=[str(folder), str(disk)], default_reward="exact_match")
    assert check_data(data)["train_rows"] == 5 + 4
    ds = FileDataset(data)
    assert ds.row(4).answer == "3" and ds.row(5 + 3).answer == "6" and ds.row(5 + 3).data_source == "src_a"


def _chat(i: int, label: str | None = None, answer: str | None = None, source: str | None = None) -> dict:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{i} + 1?"}]
    if answer is not None:
        msgs.append({"role": "assistant", "content": answer})
    row: dict = {"messages": msgs, "label": label}
    if source is not None:
        row["data_source"] = source
    return row


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_messages_without_labels_refused_for_label_rewards_and_none_for_functions(tmp_path, suffix) -> None:
    """A messages row with no label and no final assistant message: refused at start-up, naming
    file, row and the label key, when its reward compares with a label (exact match, the GSM8K
    and math-verify built-ins); a verl file scoring it gets ground_truth=None (verl's .get())."""
    from moe_async.rollout.row_rewards import RowReward

    write = write_jsonl if suffix == "jsonl" else write_parquet
    rows = [_chat(0, label="1"), _chat(1, answer="2"), _chat(2), _chat(3, label="4")]
    p = write(tmp_path / f"chat.{suffix}", rows)
    line = " (line 3)" if suffix == "jsonl" else ""
    _refused(DataConfig(train=str(p), default_reward="exact_match"), "data.train", f"chat.{suffix}",
             f"row 2{line}: no label: key 'label' (data.label_key)", "reward 'exact_match'")
    _refused(DataConfig(train=str(p), label_key="gold", default_reward="exact_match"), "row 0", "key 'gold'")
    # per data_source: the labelled gsm8k rows pass; the unlabelled 'judge' rows go to a verl file
    verl_file = Path(__file__).resolve().parents[1] / "rollout/_verl_reward.py"
    rows = [_chat(0, label="#### 1", source="openai/gsm8k"), _chat(1, source="judge"),
            _chat(2, answer="3", source="openai/gsm8k"), _chat(3, source="judge")]
    p = write(tmp_path / f"mixed.{suffix}", rows)
    data = DataConfig(train=str(p), rewards={"judge": f"verl:{verl_file}"})
    assert check_data(data)["data_sources"] == {"openai/gsm8k": "gsm8k", "judge": f"verl:{verl_file}"}
    ds = FileDataset(data)
    judge, gsm = ds.row(1), ds.row(2)
    assert (judge.has_label, judge.answer, gsm.has_label, gsm.answer) == (False, "", True, "3")
    score = RowReward(data.rewards, data.default_reward)
    assert score(judge, "anything") == 1.0  # the verl file saw ground_truth None
    assert score(ds.row(0), "#### 1") == 1.0
    rows[3] = _chat(3, source="openai/gsm8k")  # an unlabelled row of a labelled source: refused
    p = write(tmp_path / f"mixed2.{suffix}", rows)
    line = " (line 4)" if suffix == "jsonl" else ""
    _refused(DataConfig(train=str(p), rewards={"judge": f"verl:{verl_file}"}), f"mixed2.{suffix}",
             f"row 3{line}: no label", "reward 'gsm8k'", "data_source 'openai/gsm8k'")
    _refused(DataConfig(train=str(write_jsonl(tmp_path / "t.jsonl", slime_rows(2))), default_reward="exact_match",
                        eval={"held": {"path": str(p)}}), "data.eval.held", "no label")


def test_max_prompt_length_beyond_the_context_refused_naming_both_numbers(tmp_path) -> None:
    """data.max_prompt_length + rollout.max_new_tokens over the model's context (cpu_smoke: 512
    tokens, max_new_tokens 8) is refused by train before any process; 504 fits exactly."""
    from moe_async.config import load_config
    from moe_async.data.check import check_prompt_room
    from moe_async.errors import UserInputError
    from moe_async.orchestration.driver import run_experiment

    data = DataConfig(train=str(write_jsonl(tmp_path / "s.jsonl", slime_rows(2))), max_prompt_length=504)
    check_prompt_room(data, 8, {"max_position_embeddings": 512}, "m")  # 504 + 8 = 512: fits
    with pytest.raises(DataError, match=r"data.max_prompt_length=505 plus rollout.max_new_tokens=8 is 513 tokens, "
                       r"more than the model's context of 512 tokens \(max_position_embeddings of m\): set "
                       r"data.max_prompt_length <= 504"):
        check_prompt_room(data.model_copy(update={"max_prompt_length": 505}), 8, {"max_position_embeddings": 512}, "m")
    out = tmp_path / "runs"
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs/cpu_smoke.yaml", [f"data.train={data.train}", "data.default_reward=exact_match",
                                                        "data.max_prompt_length=4096", f"logging.output_dir={out}"])
    with pytest.raises(UserInputError, match=r"data.max_prompt_length=4096 plus rollout.max_new_tokens=8 .* "
                       r"context of 512 tokens \(max_position_embeddings of model.source=random_moe\)"):
        run_experiment(cfg)
    assert not out.exists()  # before the run dir, the model, Ray or any engine

"""``teacher.model_path`` is checked before any engine starts: a config.json that is not JSON
or has no integer vocab_size is named with its file, and the teacher's tokenizer (loaded by
transformers from the checkpoint, as the engine loads it) must be the student's: same
vocabulary token -> id and same special tokens, each difference named."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from moe_async.errors import UserInputError
from moe_async.orchestration.teacher_pool import teacher_model_path

WORDS = ["<s>", "</s>", "<unk>", "one", "two", "three", "plus", "is"]


def _ckpt(d, vocab=None, eos="</s>", config=None):
    d.mkdir()
    vocab = vocab or {w: i for i, w in enumerate(WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token=eos, unk_token="<unk>").save_pretrained(d)
    (d / "config.json").write_text(config if config is not None else json.dumps({"vocab_size": len(vocab)}))
    return str(d)


def _cfg(path):
    return SimpleNamespace(teacher=SimpleNamespace(model_path=path))


def test_same_tokenizer_passes_and_the_students_own_checkpoint_needs_no_compare(tmp_path):
    student = _ckpt(tmp_path / "student")
    teacher = _ckpt(tmp_path / "teacher")
    assert teacher_model_path(_cfg(teacher), student) == teacher
    assert teacher_model_path(_cfg(None), student) == student


@pytest.mark.parametrize("config, why", [
    ("{not json", r"config.json is not a readable JSON file \(JSONDecodeError"),
    ("[1, 2]", r"config.json has vocab_size=None, want a positive integer"),
    ('{"vocab_size": "8"}', r"config.json has vocab_size='8', want a positive integer"),
])
def test_bad_config_json_is_named(tmp_path, config, why):
    student = _ckpt(tmp_path / "student")
    teacher = _ckpt(tmp_path / "teacher", config=config)
    with pytest.raises(UserInputError, match=rf"teacher.model_path='{teacher}': {teacher}/{why}"):
        teacher_model_path(_cfg(teacher), student)


def test_another_tokenizer_is_refused_naming_the_difference(tmp_path):
    student = _ckpt(tmp_path / "student")
    swapped = {w: i for i, w in enumerate(WORDS)}
    swapped["one"], swapped["two"] = 4, 3
    t1 = _ckpt(tmp_path / "swapped", vocab=swapped)
    with pytest.raises(UserInputError, match=r"its tokenizer is not the student's .*2 tokens have other ids, "
                       r"e.g. 'one': 3 in the student's, 4 in the teacher's"):
        teacher_model_path(_cfg(t1), student)
    other = {w: i for i, w in enumerate(WORDS[:-1] + ["minus"])}
    t2 = _ckpt(tmp_path / "other", vocab=other)
    with pytest.raises(UserInputError, match=r"1 of the student's tokens are not in the teacher's vocabulary, "
                       r"e.g. 'is' \(id 7\)"):
        teacher_model_path(_cfg(t2), student)
    t3 = _ckpt(tmp_path / "eos", eos="<s>")
    with pytest.raises(UserInputError, match=r"eos_token differs: '</s>' in the student's, '<s>' in the teacher's"):
        teacher_model_path(_cfg(t3), student)
    (tmp_path / "notok").mkdir()
    (tmp_path / "notok" / "config.json").write_text('{"vocab_size": 8}')
    with pytest.raises(UserInputError, match=r"no tokenizer loads from .*notok"):
        teacher_model_path(_cfg(str(tmp_path / "notok")), student)

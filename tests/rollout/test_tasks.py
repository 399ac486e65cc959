"""TaskDataset on real reasoning-gym basic_arithmetic: splits, prompts, extraction, score;
plus the RolloutManager end to end with the real tokenizer and an oracle fake engine."""

from __future__ import annotations

import asyncio

import pytest

from moe_async.rollout.config import RolloutConfig
from moe_async.rollout.manager import RolloutManager
from moe_async.rollout.reward import RewardPool
from moe_async.rollout.tasks import TaskDataset, extract_answer


@pytest.fixture(scope="module")
def tokenizer():
    from moe_async.models.prepare import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


def _cfg(**kw) -> RolloutConfig:
    base = dict(train_size=200, eval_size=16)
    base.update(kw)
    return RolloutConfig(**base)


def test_demo_task_defaults() -> None:
    cfg = RolloutConfig()
    assert cfg.task == "basic_arithmetic"
    assert cfg.task_kwargs["operators"] == ["+", "-"] and cfg.task_kwargs["max_digits"] == 1
    assert cfg.task_kwargs["allow_negation"] is False and cfg.task_kwargs["allow_parentheses"] is False
    assert RolloutConfig(task="chain_sum").task_kwargs == {}


def test_splits_disjoint_and_fixed() -> None:
    a = TaskDataset(_cfg())
    b = TaskDataset(_cfg())
    assert len(a.train) == 200 and len(a.eval) == 16
    train_q = {p.question for p in a.train}
    assert not train_q & {p.question for p in a.eval}
    assert len({p.question for p in a.eval}) == 16
    assert [p.question for p in a.eval] == [p.question for p in b.eval]
    assert [p.question for p in a.train] == [p.question for p in b.train]
    # a train set covering most of a question space still leaves 16 disjoint ones (1-digit
    # terms with reasoning-gym's negation and parentheses: a larger space than the demo's)
    wide = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+", "-"])
    big = TaskDataset(_cfg(train_size=2000, task_kwargs=wide))
    assert len(big.eval) == 16 and not {p.question for p in big.train} & {p.question for p in big.eval}


def test_demo_space_leaves_held_out_problems() -> None:
    """The demo's task (no negation, no parentheses) has 242 distinct questions: the demo's
    120 train problems leave its 48 held-out ones; 2000 would leave none (a warning)."""
    demo = TaskDataset(_cfg(train_size=120, eval_size=48))
    assert len(demo.eval) == 48
    assert not {p.question for p in demo.train} & {p.question for p in demo.eval}
    assert all("(" not in p.question and "--" not in p.question.replace(" ", "") for p in demo.train)
    assert len(TaskDataset(_cfg(train_size=2000, eval_size=48)).eval) == 0


def test_epoch_iteration_seeded() -> None:
    a, b = TaskDataset(_cfg(train_size=20, eval_size=0)), TaskDataset(_cfg(train_size=20, eval_size=0))
    ea = [a.next_train().index for _ in range(40)]
    assert ea == [b.next_train().index for _ in range(40)]
    assert sorted(ea[:20]) == list(range(20)) and sorted(ea[20:]) == list(range(20))
    assert ea[:20] != ea[20:]  # reshuffled each epoch
    st = a.state_dict()
    nxt = [a.next_train().index for _ in range(5)]
    b.load_state_dict(st)
    assert [b.next_train().index for _ in range(5)] == nxt


@pytest.mark.parametrize("text,want", [
    ("3 + 4 = 7. The answer is 7.", "7"),
    ("The answer is -12", "-12"),
    ("the answer is: **-3**.", "-3"),
    ("The answer is \\boxed{5}.", "5"),
    ("5 - 3 = 2", "2"),
    ("We get 1,234 in total", "1234"),
    ("no digits here", None),
    ("", None),
    ("The answer is \u22124.", "-4"),
])
def test_extract_answer(text, want) -> None:
    assert extract_answer(text) == want


def test_score_exact_match_on_real_entries() -> None:
    ds = TaskDataset(_cfg())
    for p in ds.train[:20]:
        assert ds.score(p, f"{p.question} The answer is {p.answer}.") == 1.0
        wrong = str(int(p.answer) + 1)
        assert ds.score(p, f"The answer is {wrong}.") == 0.0
        # reasoning-gym gives partial credit when the gold string is inside the answer
        near = p.answer + "0"
        assert 0.0 < ds._train_ds.score_answer(near, p.entry) < 1.0
        assert ds.score(p, f"The answer is {near}.") == 0.0
        assert ds.score(p, "") == 0.0


def test_prompt_one_shot_and_system(tokenizer) -> None:
    ds = TaskDataset(_cfg(), tokenizer)
    p = ds.eval[0]
    ids = ds.build_prompt_ids(p)
    text = tokenizer.decode(ids)
    assert "SmolLM" not in text  # no injected default system prompt
    assert ds.cfg.system_prompt in text
    assert "The answer is 7." in text and text.rstrip().endswith("assistant")
    assert text.count(p.question) == 1 and text.index("The answer is 7.") < text.index(p.question)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(ids[0]) == 5  # system, example user/assistant, user, generation prompt
    plain = TaskDataset(_cfg(prompt_style="plain"), tokenizer)
    assert "The answer is 7." not in tokenizer.decode(plain.build_prompt_ids(p))


class OracleEngine:
    """Answers right for even requests, wrong for odd ones (by decoding the question)."""

    def __init__(self, tok, answers: dict[str, str]):
        self.tok, self.answers, self.n = tok, answers, 0

    async def generate(self, input_ids, sampling_params, return_logprob=True, return_routed_experts=False):
        from types import SimpleNamespace

        text = self.tok.decode(input_ids)
        q = text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
        ans = self.answers[q] if self.n % 2 == 0 else "1" + self.answers[q]
        self.n += 1
        ids = self.tok.encode(f"The answer is {ans}.", add_special_tokens=False) + [self.tok.eos_token_id]
        ids = ids[: sampling_params["max_new_tokens"]]
        return SimpleNamespace(output_ids=ids, output_logprobs=[-0.1] * len(ids), finish_reason="stop",
                               weight_version=0, output_token_weight_versions=[0] * len(ids),
                               routed_experts=None, prompt_tokens=len(input_ids))


def test_manager_end_to_end_real_task(tokenizer) -> None:
    cfg = _cfg(n_samples_per_prompt=4, max_concurrent_groups=2, max_new_tokens=24)
    ds = TaskDataset(cfg, tokenizer)
    answers = {p.question: p.answer for p in ds.train + ds.eval}
    eng = OracleEngine(tokenizer, answers)

    class Buf:
        admit_waits = False

        def __init__(self):
            self.n, self.groups = 0, []

        async def admit(self):
            self.n += 1
            return 0 if self.n <= 2 else None

        async def put(self, g):
            self.groups.append(g)

        async def cancel(self, reason: str = "cancelled"):
            raise AssertionError("nothing should be cancelled")

    buf = Buf()
    pool = RewardPool(ds.score, timeout_s=30.0, max_workers=1, use_processes=True)
    m = RolloutManager(cfg, ds, [eng], buf, pool, eos_token_ids=[tokenizer.eos_token_id],
                       max_context_len=8192)

    async def main():
        stop = asyncio.Event()
        t = asyncio.create_task(m.run(stop))
        while len(buf.groups) < 2:
            await asyncio.sleep(0.01)
        stop.set()
        await t
        return await m.evaluate(ds.eval_problems()[:4], 24)

    try:
        ev = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        pool.close()
    rewards = [s.reward for g in buf.groups for s in g.samples]
    assert sorted(rewards) == [0.0] * 4 + [1.0] * 4
    assert all(s.reward_error is None for g in buf.groups for s in g.samples)
    assert ev["n"] == 4 and ev["accuracy"] == 0.5

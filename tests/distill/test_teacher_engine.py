"""The teacher scores the student's exact token ids through SGLang's /generate (the embedded
engine here: a real server process) and its per-token logprobs equal transformers' for the same
model and tokens within 1e-4: a different teacher model, and a teacher prompt (few-shot turns
and its own system prompt) that the student does not see. Failures are counted, and a teacher
that never answers stops the loop with an error naming it."""

import asyncio
import os
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "engines"))
sys.path.insert(0, os.path.join(HERE, "..", "models"))

from _sglang_import import load_io_struct  # noqa: E402
from _tiny_engine import launch_tiny_chat_engine  # noqa: E402

from moe_async.distill.config import TeacherConfig  # noqa: E402
from moe_async.distill.teacher import TeacherFailureError, TeacherScorer, make_teacher_prompt_fn  # noqa: E402
from moe_async.engines.client import EngineClient, _Calls  # noqa: E402
from moe_async.rollout.config import RolloutConfig  # noqa: E402
from moe_async.rollout.tasks import TaskDataset  # noqa: E402
from moe_async.types import Sample  # noqa: E402

TASK_KW = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with launch_tiny_chat_engine(tmp_path_factory.mktemp("teacher")) as s:
        yield s


def hf_logp(model, prompt: list[int], resp: list[int]) -> torch.Tensor:
    with torch.no_grad():
        lp = model(torch.tensor([prompt + resp])).logits[0].double().log_softmax(-1)
    P = len(prompt)
    return lp[P - 1: P - 1 + len(resp)].gather(-1, torch.tensor(resp).unsqueeze(-1)).squeeze(-1)


def student_samples(student, prompt: list[int], n: int = 3, R: int = 10) -> list[Sample]:
    """``n`` responses sampled from the student (T=1), with its own logprobs."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        ids = list(prompt)
        for _ in range(R):
            with torch.no_grad():
                p = student(torch.tensor([ids])).logits[0, -1].double().softmax(-1)
            ids.append(int(torch.multinomial(p, 1, generator=g)))
        resp = ids[len(prompt):]
        out.append(Sample(list(prompt), resp, hf_logp(student, prompt, resp).tolist(), [0] * R))
    return out


def score(cfg, urls, fn, problem, samples, **client_kw):
    async def go():
        clients = [EngineClient(u, timeout_s=30, **client_kw) for u in urls]
        sc = TeacherScorer(cfg, clients, fn, source="test teacher")
        try:
            await sc.score_group(problem, samples)
        finally:
            for c in clients:
                await c.aclose()
        return sc

    return asyncio.run(go())


def test_scoring_request_is_one_sglang_accepts():
    io = load_io_struct()
    call = _Calls.score.spec(_Calls(), [5, 6, 7, 8], 2, top_logprobs_num=3)  # the request the endpoint sends
    ref = io.GenerateReqInput(**call.json)
    ref.normalize_batch_and_arguments()  # SGLang's own decoding of the request
    # one before the first scored token: SGLang gives the token AT logprob_start_len no logprob
    assert ref.return_logprob and ref.logprob_start_len == 1 and ref.top_logprobs_num == 3
    assert ref.sampling_params == {"max_new_tokens": 0} and ref.input_ids == [5, 6, 7, 8]


def test_different_teacher_model_equals_transformers(served, tmp_path):
    from _tiny import make_tiny_mixtral
    from transformers import AutoModelForCausalLM

    student_dir = make_tiny_mixtral(str(tmp_path / "student"), vocab_size=len(served.tokenizer),
                                    max_position_embeddings=256, bos_token_id=1, seed=2)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype="float32").eval()
    prompt = served.tokenizer("Two plus three is")["input_ids"]
    samples = student_samples(student, prompt)
    sc = score(TeacherConfig(enabled=True), [served.url], lambda p, ids: list(ids), None, samples)
    diffs, gaps = [], []
    for s in samples:
        ref = hf_logp(served.model, s.prompt_ids, s.response_ids)
        assert len(s.teacher_logprobs) == len(s.response_ids)
        diffs.append(float((torch.tensor(s.teacher_logprobs, dtype=torch.float64) - ref).abs().max()))
        gaps.append(max(abs(a - b) for a, b in zip(s.rollout_logprobs, s.teacher_logprobs)))
    assert max(diffs) < 1e-4, diffs
    assert max(gaps) > 0.1  # the teacher is another model: its logprobs differ from the student's
    m = sc.metrics()
    assert m["teacher/requests"] == 3 and m["teacher/failures"] == 0 and m["teacher/tokens"] == 30
    kl = sum(a - b for s in samples for a, b in zip(s.rollout_logprobs, s.teacher_logprobs)) / 30
    assert m["teacher/kl_per_token"] == pytest.approx(kl, rel=1e-12)


def test_teacher_top_k_equals_transformers(served):
    """``top_logprobs_num`` on the scoring call: per response token the teacher's k best ids equal
    transformers' top-k of the same log-softmax (float64) and their logprobs agree within 1e-4;
    the first response token is scored too (the call asks from one position earlier)."""
    tok = served.tokenizer
    prompt = tok("Two plus three is")["input_ids"]
    resp = tok(" five, and six minus one is five.", add_special_tokens=False)["input_ids"]
    samples = [Sample(list(prompt), list(resp), [0.0] * len(resp), [0] * len(resp))]
    k = 8
    sc = score(TeacherConfig(enabled=True, topk_forward_kl_coef=1.0, top_k=k), [served.url], lambda p, ids: list(ids),
               None, samples)
    s = samples[0]
    assert sc.metrics()["teacher/failures"] == 0 and s.teacher_topk_ids.shape == (len(resp), k)
    with torch.no_grad():
        lp = served.model(torch.tensor([prompt + resp])).logits[0].double().log_softmax(-1)
    v, i = torch.topk(lp[len(prompt) - 1: len(prompt) - 1 + len(resp)], k + 1)
    assert float((v[:, k - 1] - v[:, k]).min()) > 1e-3  # no near-tie at the k-th place: the ids are well defined
    assert s.teacher_topk_ids.tolist() == i[:, :k].tolist()
    assert float((torch.from_numpy(s.teacher_topk_logprobs).double() - v[:, :k]).abs().max()) < 1e-4
    assert float((torch.tensor(s.teacher_logprobs, dtype=torch.float64) - hf_logp(served.model, prompt, resp)).abs().max()) < 1e-4


def test_teacher_prompt_equals_transformers(served):
    tok = served.tokenizer
    ds = TaskDataset(RolloutConfig(task="basic_arithmetic", task_kwargs=TASK_KW, train_size=20, eval_size=0,
                                   prompt_style="plain"), tok)
    cfg = TeacherConfig(enabled=True, few_shot=2, system_prompt="You are a careful teacher.")
    fn = make_teacher_prompt_fn(cfg, ds, "basic_arithmetic", TASK_KW)
    problem = ds.next_train()
    student_prompt = ds.build_prompt_ids(problem)
    teacher_prompt = fn(problem, student_prompt)
    text = tok.decode(teacher_prompt)
    assert "You are a careful teacher." in text and problem.question in text
    assert text.count("The answer is") == 2 and tok.decode(student_prompt).count("The answer is") == 1  # its system
    resp = tok("The answer is 7.<|im_end|>", add_special_tokens=False)["input_ids"]
    samples = [Sample(list(student_prompt), resp, [0.0] * len(resp), [0] * len(resp)) for _ in range(2)]
    score(cfg, [served.url], fn, problem, samples)
    ref = hf_logp(served.model, teacher_prompt, resp)
    for s in samples:
        assert float((torch.tensor(s.teacher_logprobs, dtype=torch.float64) - ref).abs().max()) < 1e-4
    # the prompt matters: under the student's own prompt the same tokens score otherwise
    assert float((hf_logp(served.model, student_prompt, resp) - ref).abs().max()) > 1e-2


def test_failures_are_counted_and_a_dead_teacher_stops(served):
    from moe_async.engines.base import free_port

    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    samples = [Sample([1, 2, 3], [4, 5], [-1.0, -1.0], [0, 0]) for _ in range(3)]
    cfg = TeacherConfig(enabled=True, max_consecutive_failures=3)
    with pytest.raises(TeacherFailureError, match=r"test teacher\) failed to score 3 samples in a row.*"
                       r"teacher.max_consecutive_failures=3"):
        score(cfg, [dead], lambda p, ids: list(ids), None, samples, retries=1)
    assert all(s.teacher_logprobs is None and "teacher_error" in s.metadata for s in samples)
    # one live engine among dead ones: only the requests routed to the dead one fail, counted
    sc = score(TeacherConfig(enabled=True, max_consecutive_failures=0), [served.url, dead],
               lambda p, ids: list(ids), None, samples, retries=1)
    m = sc.metrics()
    assert m["teacher/requests"] == 3 and m["teacher/failures"] == 1 and m["teacher/errors"] == 1
    assert sum(s.teacher_logprobs is None for s in samples) == 1


def test_one_shot_teacher_sees_exactly_the_one_shot_prompt():
    """``few_shot: 1`` (the demo's teacher) is the ``one_shot`` prompt style token for token, so
    the teacher's held-out accuracy is that prompt's (a run with rollout.prompt_style=one_shot)."""
    from moe_async.models.prepare import load_smollm2_tokenizer

    tok = load_smollm2_tokenizer()
    kw = dict(task="basic_arithmetic", task_kwargs=TASK_KW, train_size=5, eval_size=0)
    student = TaskDataset(RolloutConfig(prompt_style="plain", **kw), tok)
    one_shot = TaskDataset(RolloutConfig(prompt_style="one_shot", **kw), tok)
    fn = make_teacher_prompt_fn(TeacherConfig(enabled=True, few_shot=1), student, "basic_arithmetic", TASK_KW)
    for p in student.train:
        ids = student.build_prompt_ids(p)
        assert fn(p, ids) == one_shot.build_prompt_ids(p) != ids

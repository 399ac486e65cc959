"""On-policy distillation's top-k forward KL term: its value for a hand-built case equals the
formula, its gradient w.r.t. the student's logits equals a plain PyTorch reference (autograd on
``log_softmax``, float64) and the closed form ``M * softmax - p_T``; the GRPO loss adds it per
token weighted by the off-policy correction's ``w`` and the loss mask; the teacher scorer asks
for ``top_logprobs_num`` and refuses a bad top-k reply; the top-k rides in the buffer snapshot."""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe_async.buffer.snapshot import sample_from_dict, sample_to_dict
from moe_async.distill.advantages import distill_metrics
from moe_async.distill.config import TeacherConfig
from moe_async.distill.teacher import TeacherScorer
from moe_async.engines.replies import ScoreOutput
from moe_async.trainer.loss import grpo_token_loss, topk_forward_kl
from moe_async.types import Group, Sample

# teacher top-3 logprobs of two positions (log of dyadic probabilities, the last row leaving
# mass 0.125 outside the top-k) and the student's logprobs at the same ids
TEACHER = [[math.log(0.5), math.log(0.25), math.log(0.125)], [math.log(0.75), math.log(0.125), math.log(0.0625)]]
STUDENT = [[-1.0, -2.0, -0.5], [-0.25, -3.0, -1.5]]


def _formula(teacher: list[float], student: list[float]) -> float:
    """sum_j p_T(j) (log p_T(j) - log p_S(j)), left to right in Python floats."""
    out = 0.0
    for t, s in zip(teacher, student):
        out += math.exp(t) * (t - s)
    return out


def test_topk_forward_kl_equals_the_formula_exactly():
    kl = topk_forward_kl(torch.tensor(STUDENT, dtype=torch.float64), torch.tensor(TEACHER, dtype=torch.float64))
    assert kl.dtype == torch.float64 and kl.shape == (2,)
    assert kl.tolist() == [_formula(t, s) for t, s in zip(TEACHER, STUDENT)]
    # at the student p_S = p_T / M on the top-k the value is M log M (the minimum, <= 0)
    M = sum(math.exp(t) for t in TEACHER[1])
    at_min = topk_forward_kl(torch.tensor([[t - math.log(M) for t in TEACHER[1]]], dtype=torch.float64),
                             torch.tensor([TEACHER[1]], dtype=torch.float64))
    assert at_min.item() == pytest.approx(M * math.log(M), abs=1e-15) and at_min.item() < 0


@pytest.mark.parametrize("correction", ["none", "tis", "icepop"])
def test_grpo_loss_adds_the_term_per_token_with_w_and_the_mask(correction):
    """loss = sum_t mask_t * w_t * (pg_t + c * KL_t): with zero advantages only the KL term, exact
    in float64; tokens without the teacher's top-k or with mask 0 add nothing (a NaN KL there
    included); the metrics hold the unweighted sum and token count."""
    kl = torch.tensor([[0.5, 1.25, float("nan")], [2.0, -0.25, 3.0]], dtype=torch.float64)
    has = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    roll = torch.full((2, 3), -1.0, dtype=torch.float64)
    d = torch.tensor([[0.3, -0.9, 0.1], [-0.2, 0.8, 0.0]], dtype=torch.float64)  # in/out of the bands
    logp = roll + d
    loss, m = grpo_token_loss(logp, torch.zeros(2, 3, dtype=torch.float64), mask, roll,
                              off_policy_correction=correction, tis_cap=2.0, icepop_beta=2.0,
                              topk_kl=kl, topk_kl_mask=has, topk_kl_coef=0.5)
    ref, ksum, n = 0.0, 0.0, 0
    for b in range(2):
        for t in range(3):
            if mask[b, t] == 0 or has[b, t] == 0:
                continue
            r = math.exp(d[b, t].item())
            w = {"none": 1.0, "tis": min(r, 2.0), "icepop": r if 0.5 <= r <= 2.0 else 0.0}[correction]
            ref += 0.5 * w * kl[b, t].item()
            ksum += kl[b, t].item()
            n += 1
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(ref, rel=1e-15, abs=1e-15)
    assert m["topk_kl_sum"].item() == ksum and m["topk_kl_tokens"].item() == n == 4
    assert m["topk_kl_loss"].item() == pytest.approx(ref / 5, rel=1e-15)  # token mean over the 5 loss tokens
    assert m["pg_loss"].item() == 0.0 and not m["nonfinite_rows"].any()
    with pytest.raises(ValueError, match="topk_kl needs topk_kl_mask"):
        grpo_token_loss(logp, torch.zeros(2, 3), mask, roll, topk_kl=kl)


def test_gradient_wrt_student_logits_equals_plain_pytorch_reference():
    """The loss through moe_async (log_softmax at the ids -> topk_forward_kl -> grpo_token_loss,
    TIS weights, loss mask, ids gathered from a vocabulary of 11) vs autograd on a plain
    float64 reference written from the formula, and the closed form c * w * (M softmax - p_T)."""
    g = torch.Generator().manual_seed(3)
    N, V, k = 5, 11, 4
    logits = (torch.randn(N, V, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(N)])
    t_lp = torch.log_softmax(torch.randn(N, V, generator=g, dtype=torch.float64) * 2, -1).gather(-1, ids)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    has = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    roll = torch.log_softmax(logits.detach(), -1)[:, 0] + torch.tensor([0.3, -0.2, 0.0, 0.5, -1.5], dtype=torch.float64)
    c = 0.7

    s_lp = torch.log_softmax(logits, -1)
    loss, _ = grpo_token_loss(s_lp[:, 0][None], torch.zeros(1, N, dtype=torch.float64), mask[None], roll[None],
                              off_policy_correction="tis", tis_cap=2.0,
                              topk_kl=topk_forward_kl(s_lp.gather(-1, ids), t_lp)[None], topk_kl_mask=has[None],
                              topk_kl_coef=c)
    (grad,) = torch.autograd.grad(loss, logits)

    ref_logits = logits.detach().clone().requires_grad_(True)
    lp = torch.log_softmax(ref_logits, -1)  # plain reference from the formula
    w = torch.clamp(torch.exp(lp[:, 0].detach() - roll), max=2.0)
    p_t = t_lp.exp()
    per_tok = (p_t * (t_lp - lp.gather(-1, ids))).sum(-1)
    ref_loss = (c * w * per_tok * mask * has).sum()
    (ref,) = torch.autograd.grad(ref_loss, ref_logits)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-14)
    assert (grad - ref).abs().max().item() < 1e-6 and ref.abs().max().item() > 0.05
    # closed form: c * w * (M softmax(z) - p_T scattered), rows with a token that counts
    closed = torch.zeros(N, V, dtype=torch.float64).scatter(-1, ids, p_t)
    closed = (c * w * mask * has)[:, None] * (p_t.sum(-1, keepdim=True) * lp.detach().exp() - closed)
    assert (grad - closed).abs().max().item() < 1e-12


class _Teacher:
    """A teacher client answering ``score`` with the log-softmax of fixed logits per position,
    and top-k rows as SGLang's client parses them; ``bad`` spoils the top-k rows."""

    base_url = "http://teacher-t:1"

    def __init__(self, V=9, bad=None):
        self.V, self.bad, self.asked = V, bad, []

    async def score(self, input_ids, logprob_start_len, top_logprobs_num=0):
        self.asked.append(top_logprobs_num)
        g = torch.Generator().manual_seed(len(input_ids))
        lp = torch.log_softmax(torch.randn(len(input_ids), self.V, generator=g), -1)
        rows = range(logprob_start_len, len(input_ids))
        toks = [lp[p - 1, input_ids[p]].item() for p in rows]
        top = None
        if top_logprobs_num:
            top = []
            for p in rows:
                v, i = torch.topk(lp[p - 1], top_logprobs_num)
                top.append([(int(a), float(b)) for a, b in zip(i, v)])
            if self.bad == "short":
                top[1] = top[1][:-1]
            elif self.bad == "dup":
                top[0][1] = top[0][0]
        return ScoreOutput(toks, top)


def _score(cfg, teacher, R=3):
    s = Sample([1, 2], [3 + i for i in range(R)], [-0.5] * R, [0] * R)
    sc = TeacherScorer(cfg, [teacher], lambda p, ids: list(ids))
    asyncio.run(sc.score_group(SimpleNamespace(index=0), [s]))
    return s, sc


def test_scorer_asks_for_top_k_and_keeps_it_per_response_token():
    t = _Teacher()
    s, _ = _score(TeacherConfig(enabled=True, topk_forward_kl_coef=1.0, top_k=4), t)
    assert t.asked == [4] and s.teacher_topk_ids.shape == (3, 4) and s.teacher_topk_logprobs.dtype == np.float32
    lp = torch.log_softmax(torch.randn(5, 9, generator=torch.Generator().manual_seed(5)), -1)
    v, i = torch.topk(lp[1:4], 4)  # response token j scored at position 2 + j, by the logits at 1 + j
    assert s.teacher_topk_ids.tolist() == i.tolist()
    assert np.array_equal(s.teacher_topk_logprobs, v.numpy())
    s.validate()
    s2, _ = _score(TeacherConfig(enabled=True), _Teacher())  # no top-k term: none asked
    assert s2.teacher_topk_ids is None and s2.teacher_logprobs is not None


@pytest.mark.parametrize("bad,why", [("short", r"top logprobs of shape \(3,\) .*want \(3, 4\)|not \(token id"),
                                     ("dup", "scored token 0 are not 4 distinct ids")])
def test_bad_top_k_reply_is_a_counted_failure(bad, why):
    s, sc = _score(TeacherConfig(enabled=True, topk_forward_kl_coef=1.0, top_k=4, max_consecutive_failures=0),
                   _Teacher(bad=bad))
    assert s.teacher_logprobs is None and s.teacher_topk_ids is None
    assert sc.metrics()["teacher/bad_replies"] == 1
    assert s.metadata["teacher_error"].startswith("http://teacher-t:1: bad reply for problem 0 sample 0")
    import re

    assert re.search(why, s.metadata["teacher_error"]), s.metadata["teacher_error"]


def test_top_k_round_trips_the_buffer_snapshot_and_is_validated():
    s, _ = _score(TeacherConfig(enabled=True, topk_forward_kl_coef=1.0, top_k=4), _Teacher())
    back = sample_from_dict(json.loads(json.dumps(sample_to_dict(s))))
    assert back.teacher_topk_ids.dtype == np.int64 and np.array_equal(back.teacher_topk_ids, s.teacher_topk_ids)
    assert np.array_equal(back.teacher_topk_logprobs, s.teacher_topk_logprobs)
    old = sample_to_dict(s)
    del old["teacher_topk_ids"], old["teacher_topk_logprobs"]  # a snapshot from before the top-k
    assert sample_from_dict(old).teacher_topk_ids is None
    s.teacher_topk_ids = s.teacher_topk_ids[:2]
    with pytest.raises(ValueError, match=r"response_ids=3, teacher_topk_ids \(2, 4\)"):
        s.validate()


def test_metrics_name_the_top_k_forward_kl():
    g = [Group(0, [Sample([1], [2], [-0.5], [0], teacher_logprobs=[-0.25])])]
    assert "teacher/topk_forward_kl" not in distill_metrics(g, {"topk_tokens": 0.0, "topk_forward_kl": 0.0})
    assert distill_metrics(g, {"topk_tokens": 3.0, "topk_forward_kl": 0.125})["teacher/topk_forward_kl"] == 0.125


def test_top_k_above_the_vocabulary_is_refused_naming_the_field(tmp_path):
    from moe_async.config import ExperimentConfig
    from moe_async.errors import UserInputError
    from moe_async.orchestration.teacher_pool import check_teacher_top_k

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 16}))
    cfg = ExperimentConfig.model_validate({"teacher": {"enabled": True, "topk_forward_kl_coef": 1.0, "top_k": 17}})
    with pytest.raises(UserInputError, match=r"teacher.top_k=17 exceeds the vocabulary \(.*config.json: vocab_size 16\)"):
        check_teacher_top_k(cfg, str(tmp_path))
    check_teacher_top_k(cfg.model_copy(update={"teacher": cfg.teacher.model_copy(update={"top_k": 16})}), str(tmp_path))
    off = ExperimentConfig.model_validate({"teacher": {"enabled": True, "top_k": 17}})  # no top-k term: not checked
    check_teacher_top_k(off, str(tmp_path))


def test_scoring_reply_drops_sglangs_leading_null():
    """SGLang 0.5.23 answers ``logprob_start_len = s`` with ``[None] + logprobs[:-1]`` (the token
    AT ``s`` has none): the client asks from one before the scored tokens and drops that entry,
    top rows included; a reply of only the scored tokens is refused, naming the count."""
    from moe_async.engines.client import _Calls
    from moe_async.engines.replies import parse_score

    call = _Calls.score.spec(_Calls(), [5, 6, 7, 8], 2, top_logprobs_num=2)
    assert call.json["logprob_start_len"] == 1
    meta = {"input_token_logprobs": [[None, 6, None], [-0.5, 7, None], [-1.5, 8, None]],
            "input_top_logprobs": [None, [[-0.25, 3, None], [-0.5, 7, None]], [[-1.0, 4, None], [-1.5, 8, None]]]}
    out = parse_score({"meta_info": meta}, 2)
    assert out.token_logprobs == [-0.5, -1.5] and out.top_logprobs == [[(3, -0.25), (7, -0.5)], [(4, -1.0), (8, -1.5)]]
    with pytest.raises(ValueError, match=r"expected 3 input logprobs \(the first null\), the engine returned 2"):
        parse_score({"meta_info": {"input_token_logprobs": meta["input_token_logprobs"][1:]}}, 2)

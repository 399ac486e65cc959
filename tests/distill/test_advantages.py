"""On-policy distillation's per-token advantage, by hand, and its loss gradient against a plain
PyTorch reference written here from the formula (not from moe_async)."""

import math

import pytest
import torch

from moe_async.config import ConfigError, load_config
from moe_async.distill.advantages import distill_advantages, distill_metrics
from moe_async.trainer.loss import grpo_token_loss
from moe_async.types import Group, Sample

# two groups; logprobs chosen so every term is distinct and exactly representable
STUDENT = [[-0.5, -1.25, -2.0], [-0.75, -0.125]]
TEACHER = [[-1.0, -0.25, -2.0], [-0.5, -3.0]]
REWARDS = [1.0, 0.0]


def _groups(teacher=TEACHER):
    ss = [Sample([1, 2], list(range(3, 3 + len(st))), st, [0] * len(st), reward=r, teacher_logprobs=te)
          for st, te, r in zip(STUDENT, teacher, REWARDS)]
    return [Group(0, ss)]


def test_advantage_equals_the_formula_exactly():
    adv = distill_advantages(_groups(), kl_coef=1.0, reward_coef=0.0)
    assert adv == [[-0.5, 1.0, 0.0], [0.25, -2.875]]  # -(s - t) per token, exact in binary
    # mixed with the task reward's GRPO advantage (+-1 for rewards 1, 0: (r - 0.5) / (0.5 + 1e-6))
    g = 0.5 / (0.5 + 1e-6)
    adv = distill_advantages(_groups(), kl_coef=0.5, reward_coef=2.0)
    assert adv == [[0.5 * -(s - t) + 2.0 * g for s, t in zip(STUDENT[0], TEACHER[0])],
                   [0.5 * -(s - t) - 2.0 * g for s, t in zip(STUDENT[1], TEACHER[1])]]


def test_failed_teacher_sample_gets_only_the_reward_term():
    adv = distill_advantages(_groups([TEACHER[0], None]), kl_coef=1.0, reward_coef=0.0)
    assert adv[1] == [0.0, 0.0]
    m = distill_metrics(_groups([TEACHER[0], None]))
    assert m["teacher/batch_failed_samples"] == 1.0
    assert m["teacher/batch_kl_per_token"] == (0.5 - 1.0 + 0.0) / 3  # student - teacher, scored tokens only
    assert m["teacher/batch_kl_per_sample"] == (0.5 - 1.0 + 0.0) / 1  # summed over the one scored sample
    both = distill_metrics(_groups())
    assert both["teacher/batch_kl_per_sample"] == (sum(STUDENT[0]) - sum(TEACHER[0]) + sum(STUDENT[1]) - sum(TEACHER[1])) / 2


def test_bad_teacher_logprobs_are_named():
    bad = _groups([TEACHER[0], [-0.5, float("nan")]])
    with pytest.raises(ValueError, match="group 0 sample 1: non-finite"):
        distill_advantages(bad, 1.0, 0.0)
    short = _groups([TEACHER[0], [-0.5]])
    short[0].samples[1].teacher_logprobs = [-0.5]
    with pytest.raises(ValueError, match="group 0 sample 1: 1 teacher and 2 rollout logprobs for 2"):
        distill_advantages(short, 1.0, 0.0)


@pytest.mark.parametrize("correction", ["none", "tis", "icepop"])
def test_loss_gradient_equals_plain_pytorch_reference(correction):
    """d loss / d logp of the GRPO loss fed the per-token distillation advantages equals the plain
    reference sum_t -w_t A_t grad logp_t (ratio 1 in value, one step per batch) within 1e-12."""
    adv = distill_advantages(_groups(), 1.0, 0.0)
    T = 3
    A = torch.zeros(2, T, dtype=torch.float64)
    mask = torch.zeros(2, T, dtype=torch.float64)
    for b, a in enumerate(adv):
        A[b, : len(a)] = torch.tensor(a, dtype=torch.float64)
        mask[b, : len(a)] = 1.0
    roll = torch.tensor([STUDENT[0], STUDENT[1] + [0.0]], dtype=torch.float64)
    # train/rollout log-ratios inside and outside IcePop's band, one past the TIS cap
    logp = (roll + torch.tensor([[0.3, -0.9, 0.1], [-0.2, 0.8, 0.0]], dtype=torch.float64)).requires_grad_(True)
    loss, _ = grpo_token_loss(logp, A, mask, roll, off_policy_correction=correction, tis_cap=2.0, icepop_beta=2.0)
    loss.backward()
    # reference, from the formula
    ref = torch.zeros(2, T, dtype=torch.float64)
    for b in range(2):
        for t in range(len(adv[b])):
            r = math.exp(logp[b, t].item() - roll[b, t].item())
            w = {"none": 1.0, "tis": min(r, 2.0), "icepop": r if 0.5 <= r <= 2.0 else 0.0}[correction]
            ref[b, t] = -w * adv[b][t]
    assert torch.allclose(logp.grad, ref, atol=1e-12, rtol=0)
    assert ref.abs().max() > 0.1  # the check bites


def test_teacher_config_checks():
    c = load_config("configs/cpu_smoke.yaml", ["teacher.enabled=true", "rollout.n_samples_per_prompt=1"])
    assert c.teacher.kl_coef == 1.0  # distillation alone needs no group
    with pytest.raises(ConfigError, match="rollout.temperature=1.0"):
        load_config("configs/cpu_smoke.yaml", ["teacher.enabled=true", "rollout.temperature=0.7"])
    with pytest.raises(ConfigError, match="kl_coef, teacher.reward_coef and teacher.topk_forward_kl_coef are all 0"):
        load_config("configs/cpu_smoke.yaml", ["teacher.enabled=true", "teacher.kl_coef=0"])
    c = load_config("configs/cpu_smoke.yaml", ["teacher.enabled=true", "teacher.kl_coef=0",
                                               "teacher.topk_forward_kl_coef=0.5"])  # top-k forward KL alone
    assert (c.teacher.topk_forward_kl_coef, c.teacher.top_k) == (0.5, 20)
    with pytest.raises(ConfigError, match="teacher.top_k"):
        load_config("configs/cpu_smoke.yaml", ["teacher.enabled=true", "teacher.top_k=0"])
    with pytest.raises(ConfigError, match="n_samples_per_prompt"):
        load_config("configs/cpu_smoke.yaml", ["teacher.enabled=true", "teacher.reward_coef=1",
                                               "rollout.n_samples_per_prompt=1"])


def test_teacher_urls_that_do_not_answer_are_refused_at_start():
    """teacher.urls pointing at nothing: refused at start naming the field and the URL (it used
    to train every step on zero distillation advantages and exit 0)."""
    import pytest

    from moe_async.config import ExperimentConfig
    from moe_async.errors import UserInputError
    from moe_async.orchestration.teacher_pool import start_teacher
    from moe_async.net import free_port

    url = f"http://127.0.0.1:{free_port()}"
    cfg = ExperimentConfig.model_validate({"teacher": {"enabled": True, "urls": [url]}})
    with pytest.raises(UserInputError, match=rf"teacher\.urls: {url} did not answer /health"):
        start_teacher(cfg, "unused")


def test_few_shot_teacher_with_prompt_files_is_refused():
    """teacher.few_shot's worked examples come from rollout.task's generator: with prompt files
    they would be another task's (it used to show them silently); refused at config load and
    by the prompt builder, naming the field."""
    from types import SimpleNamespace

    from moe_async.distill.config import TeacherConfig
    from moe_async.distill.teacher import make_teacher_prompt_fn

    with pytest.raises(ConfigError, match=r"teacher.few_shot=1 with prompt files \(data.train\): the worked examples "
                       r"are drawn from rollout.task's generator"):
        load_config("configs/cpu_demo_file.yaml", ["teacher.enabled=true", "teacher.few_shot=1"])
    c = load_config("configs/cpu_demo_file.yaml", ["teacher.enabled=true", "teacher.system_prompt=Think."])
    assert c.teacher.few_shot == 0 and c.teacher.system_prompt == "Think."
    rows = SimpleNamespace(messages=lambda row: [{"role": "user", "content": "q"}], tokenizer=None)
    with pytest.raises(ValueError, match=r"teacher.few_shot=2 needs rollout.task's generated problems"):
        make_teacher_prompt_fn(TeacherConfig(enabled=True, few_shot=2), rows, "basic_arithmetic", {})

"""An environment's step result is checked field by field: a reward that is not a finite real
number (NaN, inf, a string, a bool), a ``done`` that is not a bool, an observation whose role
or content is not a string (None) are refused with an error naming the environment, its
class, the field and the value; well-formed results (SkyRL-gym's dict, an EnvStep, numpy
numbers) pass with their values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_async.agent.env_base import EnvStep, as_step


def _d(**kw):
    out = {"observations": [{"role": "user", "content": "again"}], "reward": 0.5, "done": False}
    out.update(kw)
    return out


@pytest.mark.parametrize("reward, shown", [(float("nan"), "nan"), (math.inf, "inf"), ("1.0", "'1.0'"),
                                           (True, "True"), (np.float32("nan"), r"np.float32\(nan\)"), ([1.0], r"\[1.0\]")])
def test_bad_rewards_are_refused_naming_env_field_value(reward, shown):
    with pytest.raises(ValueError, match=rf"environment 'my_env' \(MyEnv\): step\(\) reward={shown} .*not a finite"):
        as_step(_d(reward=reward), "my_env", "MyEnv")
    with pytest.raises(ValueError, match=rf"environment 'my_env' \(MyEnv\): step\(\) reward={shown}"):
        as_step(EnvStep(reward=reward), "my_env", "MyEnv")


@pytest.mark.parametrize("obs, field", [([{"role": "user", "content": None}], r"observations\[0\].content=None"),
                                        ([{"role": None, "content": "x"}], r"observations\[0\].role=None"),
                                        ([{"role": "user"}], r"observations\[0\] is not a chat message"),
                                        ("again", "observations='again' is not a list")])
def test_bad_observations_are_refused(obs, field):
    with pytest.raises(ValueError, match=rf"environment 'my_env' \(MyEnv\): step\(\) {field}"):
        as_step(_d(observations=obs), "my_env", "MyEnv")


def test_bad_done_and_metadata_are_refused():
    with pytest.raises(ValueError, match=r"step\(\) done='yes' \(str\) is not a bool"):
        as_step(_d(done="yes"), "e")
    with pytest.raises(ValueError, match=r"step\(\) done=2 \(int\) is not a bool"):
        as_step(_d(done=2), "e")
    with pytest.raises(ValueError, match=r"step\(\) metadata=\[1\] is not a dict"):
        as_step(_d(metadata=[1]), "e")


def test_good_results_keep_their_values():
    s = as_step(_d(reward=np.float64(0.25), done=np.bool_(True), metadata={"k": 1}), "e")
    assert (s.reward, s.done, s.metadata, s.observations) == (0.25, True, {"k": 1}, [{"role": "user", "content": "again"}])
    assert type(s.reward) is float and type(s.done) is bool
    s = as_step({"observations": None, "reward": None, "done": 1}, "e")
    assert (s.reward, s.done, s.observations) == (0.0, True, [])
    s = as_step(EnvStep(reward=2), "e")
    assert s.reward == 2.0 and type(s.reward) is float and s.done is False

"""An engine's update call fails during the weight sync of a 2-rank trainer group (Ray actors):
the driver's error is one line naming the engine (index and URL), the call and the engine's
own reason (tests/orchestration/_sync_error_checks.py: a real embedded engine, the real
TrainerGroup and BroadcastTransport).

Before, the driver saw Ray's ``UnserializableException: Failed to deserialize exception``
(the engine client's error could not be unpickled) and about 60 traceback lines naming no
engine; and the transport re-raised an engine's error without saying which engine it was.
"""

from __future__ import annotations

import os
import tempfile

import pytest
from _launch import run_json

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def errors():
    tmp = tempfile.mkdtemp(prefix="mray", dir="/tmp")  # short: Ray's socket paths have a length limit
    return run_json(os.path.join(HERE, "_sync_error_checks.py"), timeout=900, TMPDIR=tmp)


def test_failed_update_call_is_one_line_naming_the_engine(errors):
    url, sync = errors["url"], errors["sync"]
    msg = sync["message"]
    assert msg is not None and "\n" not in msg, msg
    assert msg.startswith(f"trainer rank 0 failed in sync_weights: WeightSyncError: engine 0 at {url}: "
                          "update_weights_from_distributed failed: EngineRequestError: "
                          "/update_weights_from_distributed -> HTTP 400: unknown weight name "
                          "'model.layers.0.block_sparse_moe.experts.9.w1.weight'"), msg
    assert msg.endswith("(all 2 trainer ranks stopped)")
    assert "Unserializable" not in msg and "Traceback" not in msg
    assert sync["cause"] == "WeightSyncError"  # what Ray handed the driver: the rank's own exception


def test_engine_client_error_raised_in_a_rank_reaches_the_driver_as_itself(errors):
    raw = errors["raw"]
    assert raw["cause"] == "EngineRequestError", raw  # not Ray's UnserializableException
    assert "\n" not in raw["message"]
    assert raw["message"].startswith("trainer rank 0 failed in refused_call: EngineRequestError: "
                                     "/update_weights_from_distributed -> HTTP 400: Group no_such_group not in"), raw

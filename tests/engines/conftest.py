"""An engine shared by several test modules of this directory (starting one is the costly part
of their tests)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_chat_engine(tmp_path_factory):
    """One real embedded engine serving the tiny chat Mixtral of ``_tiny_engine.py``, for the
    tests that only send it requests (the /generate field table, the OpenAI API, the sglang
    frontend): ``SimpleNamespace(url, model, tokenizer, model_dir)``; shut down at the end of
    the session. A test that changes the engine (weights, pause, slow_down) starts its own."""
    from _tiny_engine import launch_tiny_chat_engine

    with launch_tiny_chat_engine(tmp_path_factory.mktemp("tiny_chat_engine")) as s:
        yield s

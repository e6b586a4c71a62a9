"""Shared fixtures: the demo models and real backend processes over real HTTP."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvroute.devtools import demo_model
from tests.harness import BackendProcess, Database, SharedRedis


@pytest.fixture(autouse=True)
def no_pinned_memory(monkeypatch):
    """Tests that force the disk tier's CUDA path on this CPU never ask a CUDA runtime
    (one may be installed without a GPU) for pinned memory: their restores take MLX's
    reader and their writes device copies; tests/test_pinned.py and
    tests/test_pinned_write.py stand in for the pinned paths."""
    from kvroute.backend import pinned

    monkeypatch.setattr(pinned, "cuda_runtime", lambda: None)


@pytest.fixture(scope="session")
def redis_server():
    """One redis-server for the whole session. A module's fleet takes
    `redis_server.database()` (a database of its own, emptied); a test takes `redis_db`."""
    server = SharedRedis()
    yield server
    server.close()


@pytest.fixture
def redis_db(redis_server) -> Database:
    """An empty database of the session's Redis, this test's alone."""
    return redis_server.database()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    # Tests build their own copy so they never depend on (or pollute) ~/.cache.
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def text_model(model_cache) -> Path:
    return demo_model.ensure("text", cache_dir=model_cache)


@pytest.fixture(scope="session")
def tool_model(model_cache) -> Path:
    return demo_model.ensure("tool", cache_dir=model_cache)


@pytest.fixture(scope="session")
def backend(text_model, tmp_path_factory):
    """A text-variant backend with small prefill chunks and fault injection on."""
    proc = BackendProcess(
        text_model,
        model_id="demo",
        log_dir=tmp_path_factory.mktemp("backend-logs"),
        extra=["--prefill-step", "32", "--enable-faults", "--max-prompt-tokens", "6000",
               "--max-body-bytes", "1MiB"],
    )
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def tool_backend(tool_model, tmp_path_factory):
    proc = BackendProcess(
        tool_model, model_id="demo-tool", log_dir=tmp_path_factory.mktemp("tool-backend-logs")
    )
    proc.start()
    yield proc
    proc.stop()


def pytest_configure(config):
    # Backend children inherit this: keep MLX to the cores the suite can spare.
    os.environ.setdefault("KVROUTE_LOG_LEVEL", "info")

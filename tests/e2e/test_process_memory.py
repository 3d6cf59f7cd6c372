"""An engine a test served through an in-process app and shut down leaves the test process once
``release_freed_memory`` runs (tests/conftest.py does after any test that grew the process), so the suite's
memory stays that of its largest module instead of the sum of every engine it built."""
from __future__ import annotations

import weakref

import pytest
from fastapi.testclient import TestClient
from process_memory import release_freed_memory

from radixlang import Engine
from radixlang.runtime.entrypoints.engine_front import EngineFront
from radixlang.runtime.entrypoints.http_server import create_app

pytestmark = pytest.mark.e2e


def _served_then_shut_down(model_dir: str) -> weakref.ref:
    engine = Engine(model_path=model_dir, load_format="dummy", max_total_tokens=1024)
    with TestClient(create_app(EngineFront(engine))) as client:
        r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
    engine.shutdown()
    return weakref.ref(engine)


def test_a_shut_down_engine_behind_an_app_is_released(tiny_model_dir):
    gone = _served_then_shut_down(tiny_model_dir)
    release_freed_memory()
    assert gone() is None, "something still holds the engine (and its weights and KV pool)"

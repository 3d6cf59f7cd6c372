from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from process_memory import release_freed_memory, rss_mb  # noqa: E402
from tiny_model import make_tiny_model_dir, smollm_dir  # noqa: E402


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip)


# Every in-process app a test made (create_app(EngineFront(engine)) under a TestClient) stayed alive with its
# engine: FastAPI (0.165 here) keeps each route's endpoint in module-level lru_caches (4096 entries, in
# fastapi/dependencies/models.py), and an endpoint's closure holds the EngineFront, so the engine's weights and
# KV pool (SmolLM2: ~1.3 GB) never left and the suite grew past 14 GB. A shut-down Engine also sits in a reference
# cycle until the collector's oldest generation runs, and glibc keeps the heap pages it freed. After each test's
# teardown (a module's last test: its module fixtures too), a growth of RELEASE_ABOVE_MB since the last release
# empties those caches, collects and trims the heap.
RELEASE_ABOVE_MB = 512
_RSS_AFTER_RELEASE = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if rss_mb() - item.config.stash.get(_RSS_AFTER_RELEASE, 0) > RELEASE_ABOVE_MB:
        release_freed_memory()
        item.config.stash[_RSS_AFTER_RELEASE] = rss_mb()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def smollm_path() -> str:
    return smollm_dir()


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir):
    """One live server of the tiny model served as "tiny", shared by the HTTP test files that need nothing
    else of it (test_openai_api, test_responses_api, test_server_fuzz): one start instead of three."""
    from live_server import live_server
    with live_server(tiny_model_dir, served_model_name="tiny") as url:  # the model name the tests send
        yield url


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    from radixlang import Engine
    engine = Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=8192)
    yield engine
    engine.shutdown()

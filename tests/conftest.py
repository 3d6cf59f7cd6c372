from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def smollm_path() -> str:
    return smollm_dir()


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    from radixlang import Engine
    engine = Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=8192)
    yield engine
    engine.shutdown()

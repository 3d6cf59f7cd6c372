"""The pooling a model folder asks for (sentence-transformers' config, old and new), and the pooled vector."""
from __future__ import annotations

import json
import os

import pytest
import torch

from radixlang.runtime.errors import RequestError
from radixlang.runtime.model_executor.pooling import PooledRows, PoolingConfig, read_pooling_config

MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def _folder(root, *, pooling: dict | None, normalize: bool = False, config: dict | None = None) -> str:
    def write(name: str, obj) -> None:
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        with open(os.path.join(root, name), "w") as f:
            json.dump(obj, f)

    if pooling is not None:
        write("modules.json", MODULES + ([NORMALIZE] if normalize else []))
        write("1_Pooling/config.json", pooling)
    write("config.json", config or {})
    return str(root)


@pytest.mark.parametrize("pooling,mode", [
    ({"pooling_mode": "mean"}, "mean"),
    ({"pooling_mode": "cls"}, "cls"),
    ({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, "lasttoken"),
    ({"pooling_mode_cls_token": True}, "cls"),
])
def test_reads_new_and_legacy_pooling_configs(tmp_path, pooling, mode):
    config = read_pooling_config(_folder(tmp_path, pooling=pooling, normalize=True))
    assert config == PoolingConfig(mode=mode, normalize=True, matryoshka_dims=None)


@pytest.mark.parametrize("pooling", [{"pooling_mode": "max"}, {"pooling_mode_weightedmean_tokens": True},
                                     {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, {}])
def test_refuses_modes_it_does_not_serve(tmp_path, pooling):
    with pytest.raises(ValueError, match="pooling mode must be one of"):
        read_pooling_config(_folder(tmp_path, pooling=pooling))


def test_without_a_pooling_module_pools_the_last_token_normalized(tmp_path):
    assert read_pooling_config(_folder(tmp_path, pooling=None)) == PoolingConfig(mode="lasttoken", normalize=True)


def test_matryoshka_sizes_from_config_json(tmp_path):
    listed = read_pooling_config(_folder(tmp_path / "a", pooling=None, config={"matryoshka_dimensions": [8, 16]}))
    any_size = read_pooling_config(_folder(tmp_path / "b", pooling=None, config={"is_matryoshka": True}))
    assert listed.matryoshka_dims == (8, 16) and any_size.matryoshka_dims == ()
    listed.check_dimensions(16, 64)
    any_size.check_dimensions(5, 64)
    for config, dims in ((listed, 12), (any_size, 65), (PoolingConfig(mode="mean", normalize=True), 8)):
        with pytest.raises(RequestError) as e:
            config.check_dimensions(dims, 64)
        assert e.value.param == "dimensions"


def test_chunks_add_up_to_the_mean_and_a_cut_is_renormalized():
    rows = torch.randn(5, 8)
    config = PoolingConfig(mode="mean", normalize=True, matryoshka_dims=())
    pooled = PooledRows(positions=config.positions(5))
    pooled.add(rows[:2])
    pooled.add(rows[2:])
    assert pooled.total is not None
    full = torch.tensor(config.finish(pooled.total, 5, None))
    assert torch.allclose(full, torch.nn.functional.normalize(rows.mean(0), dim=0), atol=1e-6)
    cut = torch.tensor(config.finish(pooled.total, 5, 3))
    assert torch.allclose(cut, torch.nn.functional.normalize(rows.mean(0)[:3], dim=0), atol=1e-6)
    assert PoolingConfig(mode="lasttoken", normalize=False).positions(5) == range(4, 5)
    assert PoolingConfig(mode="cls", normalize=False).positions(5) == range(0, 1)

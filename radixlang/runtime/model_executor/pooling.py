"""Embedding pooling: how a model folder says to pool (sentence-transformers' config), and one request's
pooled vector.

sentence-transformers saves a model as modules listed in ``modules.json``: the transformer, then a
``Pooling`` module (``1_Pooling/config.json``), then optionally ``Normalize``. Its Pooling config is
``{"pooling_mode": "mean"}`` since v6, and ``pooling_mode_mean_tokens: true`` (one flag per mode) before.
CLS, mean and last-token pooling are served; a folder without a Pooling module pools the last token
and normalizes, as decoder embedding models (Qwen3-Embedding, e5-mistral) do. ``dimensions`` (Matryoshka
truncation) is allowed when config.json says ``is_matryoshka`` or lists ``matryoshka_dimensions``,
as vLLM reads it. Inputs are embedded as sent: sentence-transformers >= 6 renders a text through the
chat template when the folder lists the "message" modality (a tokenizer with a chat template), which
radixlang does not do (a warning says so at start).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch

from radixlang.runtime.errors import RequestError

logger = logging.getLogger(__name__)

PoolingMode = Literal["cls", "mean", "lasttoken"]
_MODES: tuple[PoolingMode, ...] = ("cls", "mean", "lasttoken")
# sentence-transformers < 6: one boolean per mode
_LEGACY_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean"}


@dataclass(frozen=True, kw_only=True)
class PoolingConfig:
    mode: PoolingMode
    normalize: bool
    # None: the model does not allow ``dimensions``; () any size up to the hidden size; else these sizes
    matryoshka_dims: tuple[int, ...] | None = None

    def positions(self, prompt_len: int) -> range:
        """The prompt positions whose final hidden states are pooled."""
        if self.mode == "cls":
            return range(0, 1)
        if self.mode == "mean":
            return range(0, prompt_len)
        return range(prompt_len - 1, prompt_len)

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        """Refuse a ``dimensions`` this model cannot give (RequestError naming the field)."""
        if dimensions is None:
            return
        if self.matryoshka_dims is None:
            raise RequestError("this model does not support dimensions: it is not a Matryoshka model (its "
                               "config.json has no is_matryoshka / matryoshka_dimensions)", "dimensions")
        allowed = self.matryoshka_dims or range(1, hidden_size + 1)
        if dimensions not in allowed:
            sizes = list(self.matryoshka_dims) if self.matryoshka_dims else f"1..{hidden_size}"
            raise RequestError(f"dimensions must be one of {sizes}, got {dimensions}", "dimensions")

    def finish(self, total: torch.Tensor, prompt_len: int, dimensions: int | None) -> list[float]:
        """The embedding from the sum of the pooled rows ``total`` [hidden] float32: their mean, cut to
        ``dimensions`` and then normalized when the model normalizes (so a cut vector is a unit one again)."""
        vec = total / len(self.positions(prompt_len))
        if dimensions is not None:
            vec = vec[:dimensions]
        if self.normalize:
            vec = torch.nn.functional.normalize(vec, dim=-1)
        return vec.tolist()


@dataclass(eq=False, kw_only=True)
class PooledRows:
    """One embedding request's pooling in progress: the rows of its positions summed over its prefill chunks."""
    positions: range
    dimensions: int | None = None
    total: torch.Tensor | None = None  # [hidden] float32

    def add(self, rows: torch.Tensor) -> None:
        """rows [n, hidden]: final hidden states of n of ``positions``."""
        part = rows.float().sum(dim=0)
        self.total = part if self.total is None else self.total + part


def read_pooling_config(folder: str) -> PoolingConfig:
    """The pooling a model folder asks for (see the module docstring); ValueError on a mode not served."""
    modules = _read_json(os.path.join(folder, "modules.json"))
    kinds = {str(m.get("type", "")).rpartition(".")[2]: m for m in modules} if isinstance(modules, list) else {}
    dims = _matryoshka_dims(_read_json(os.path.join(folder, "config.json")) or {})
    if "Pooling" not in kinds:
        logger.info("%s has no sentence-transformers Pooling module: pooling the last token, normalized", folder)
        return PoolingConfig(mode="lasttoken", normalize=True, matryoshka_dims=dims)
    pooling = _read_json(os.path.join(folder, str(kinds["Pooling"].get("path", "")), "config.json")) or {}
    transformer = _read_json(os.path.join(folder, "sentence_bert_config.json")) or {}
    if "message" in (transformer.get("modality_config") or {}):
        logger.warning("%s lists the message modality: sentence-transformers renders a text input through the "
                       "chat template first; radixlang embeds inputs as sent (render the template yourself to "
                       "get the same vectors)", folder)
    return PoolingConfig(mode=_pooling_mode(pooling), normalize="Normalize" in kinds, matryoshka_dims=dims)


def _pooling_mode(config: dict[str, Any]) -> PoolingMode:
    if "pooling_mode" in config:
        modes = [config["pooling_mode"]]
    else:
        modes = [mode for flag, mode in _LEGACY_FLAGS.items() if config.get(flag)]
    if len(modes) != 1 or modes[0] not in _MODES:
        raise ValueError(f"pooling mode must be one of {', '.join(_MODES)}, got {modes or 'none'}")
    mode: PoolingMode = modes[0]
    return mode


def _matryoshka_dims(config: dict[str, Any]) -> tuple[int, ...] | None:
    listed = config.get("matryoshka_dimensions")
    if listed:
        return tuple(int(d) for d in listed)
    return () if config.get("is_matryoshka") else None


def _read_json(path: str) -> Any:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)

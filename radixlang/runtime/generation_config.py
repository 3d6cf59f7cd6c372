"""Sampling defaults from the model, as vLLM's ``--generation-config auto`` takes them.

A model's ``generation_config.json`` carries the sampling its authors meant (Qwen2.5-Instruct:
temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05). A request that leaves one of those
unset gets the model's value; one it sets wins. ``--generation-config`` names the source: ``auto``
(the model's folder; a GGUF's converted folder), ``vllm`` (none: SGLang's own defaults), or a
folder holding a ``generation_config.json``. ``max_new_tokens`` is not taken: an unset budget is
capped to the context left, where a given one past it is refused, and a model default would turn
the first into the second.
"""
from __future__ import annotations

import json
import os
from typing import Any

SOURCES = ("auto", "vllm")  # or a folder
# generation_config.json keys -> SamplingParams fields (the same names)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def check_generation_config(source: str) -> None:
    """A ValueError naming the choices unless ``source`` is auto, vllm or a folder with the file."""
    if source in SOURCES:
        return
    if not os.path.isfile(os.path.join(source, "generation_config.json")):
        raise ValueError(f"generation_config must be auto, vllm or a folder holding a generation_config.json, "
                         f"got {source!r}")


def sampling_defaults(source: str, model_dir: str) -> dict[str, Any]:
    """The sampling fields a request gets when it leaves them unset (empty: SGLang's defaults)."""
    if source == "vllm":
        return {}
    path = os.path.join(model_dir if source == "auto" else source, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return {key: data[key] for key in SAMPLING_KEYS if data.get(key) is not None}

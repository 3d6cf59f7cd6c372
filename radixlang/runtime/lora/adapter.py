"""A PEFT LoRA adapter folder read into float tensors: ``adapter_config.json`` + ``adapter_model.safetensors``
(or ``adapter_model.bin``), as ``PeftModel.save_pretrained`` writes it.

Each adapted module ``m`` contributes ``delta(x) = scaling * (x @ A^T) @ B^T`` to ``m(x)``, with A [r, in],
B [out, r] and ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rslora); ``rank_pattern`` and
``alpha_pattern`` give a module its own r and alpha, matched on the module name's tail as PEFT matches
them. What this runtime cannot apply exactly is refused when the adapter is read, naming the field: DoRA,
trained biases, ``modules_to_save`` (a fully trained copy of a module), embedding or head targets,
``fan_in_fan_out`` (Conv1D-style weights).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT's prefix of a causal LM's adapter tensors: "base_model.model." + the base model's module name
_PEFT_PREFIX = "base_model.model."
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter folder this runtime cannot serve; the message names the file or field."""


@dataclass(frozen=True)
class ModuleDelta:
    """One adapted module of the base model: A [r, in] and B [out, r] float32, ``scaling`` folded into B."""
    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter as read: ``modules`` maps the base model's module names as its checkpoint spells them
    (``model.layers.0.self_attn.q_proj``) to their deltas."""
    path: str
    rank: int  # the config's r (the largest a module may have once rank_pattern applies)
    modules: dict[str, ModuleDelta]

    @property
    def num_bytes(self) -> int:
        return sum(d.a.numel() * d.a.element_size() + d.b.numel() * d.b.element_size()
                   for d in self.modules.values())


def read_adapter_config(path: str) -> dict[str, Any]:
    """The folder's adapter_config.json, checked for what the runtime can apply (AdapterError if not)."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise AdapterError(f"LoRA adapter path {path!r} is not a folder (a PEFT adapter folder holds "
                           f"{CONFIG_FILE} and adapter_model.safetensors)")
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise AdapterError(f"LoRA adapter folder {path!r} has no {CONFIG_FILE}") from None
    except json.JSONDecodeError as e:
        raise AdapterError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file} must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{file}: peft_type must be LORA, got {config.get('peft_type')!r}")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
        "modules_to_save": "modules_to_save (fully trained copies of modules) is not supported",
    }
    for key, why in refused.items():
        if config.get(key):
            raise AdapterError(f"{file}: {key} is set: {why}")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{file}: bias must be \"none\" (trained biases are not supported), got "
                           f"{config.get('bias')!r}")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise AdapterError(f"{file}: {key} must be a positive number, got {value!r}")
    return config


def _pattern_value(patterns: dict[str, Any], module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module name's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return float(default)


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    for name in _WEIGHT_FILES:
        file = os.path.join(path, name)
        if not os.path.exists(file):
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(file)
        loaded = torch.load(file, map_location="cpu", weights_only=True)
        if not isinstance(loaded, dict):
            raise AdapterError(f"{file} must hold a dict of tensors")
        return loaded
    raise AdapterError(f"LoRA adapter folder {path!r} has no {' or '.join(_WEIGHT_FILES)}")


def load_adapter(path: str) -> LoRAAdapter:
    """Read a PEFT LoRA folder: each module's A and B in float32, B scaled (AdapterError if it can't be served)."""
    config = read_adapter_config(path)
    tensors = _read_tensors(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _TENSOR.match(name)
        if m is None:
            if "lora_embedding" in name or "lora_magnitude" in name:
                raise AdapterError(f"{path}: tensor {name!r} is an embedding / DoRA adapter weight, not supported")
            raise AdapterError(f"{path}: unexpected tensor {name!r} (a LoRA adapter holds lora_A / lora_B weights)")
        module = m.group("module").removeprefix(_PEFT_PREFIX)
        pairs.setdefault(module, {})[m.group("kind")] = tensor
    if not pairs:
        raise AdapterError(f"{path}: the adapter holds no lora_A / lora_B weights")
    r, alpha = config["r"], config["lora_alpha"]
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    modules: dict[str, ModuleDelta] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: module {module!r} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{path}: module {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}: "
                               f"expected [r, in] and [out, r]")
        rank = _pattern_value(rank_pattern, module, r)
        if a.shape[0] != rank:
            raise AdapterError(f"{path}: module {module!r} has rank {a.shape[0]}, its config says {rank:g}")
        mod_alpha = _pattern_value(alpha_pattern, module, alpha)
        scaling = mod_alpha / math.sqrt(rank) if rslora else mod_alpha / rank
        modules[module] = ModuleDelta(a=a.contiguous(), b=(b * scaling).contiguous())
    return LoRAAdapter(path=path, rank=int(r), modules=modules)

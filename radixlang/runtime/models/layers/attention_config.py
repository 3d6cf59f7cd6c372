"""Per-layer attention options read from a transformers config."""
from __future__ import annotations

from typing import Any

from radixlang.kernels.attention.base import layer_features


def layer_sliding_window(config: Any, layer_id: int) -> int | None:
    """The layer's window in tokens (a query sees the keys less than that many positions back), or None.

    transformers >= 5 lists each layer's kind in ``layer_types`` ("sliding_attention" / "full_attention");
    a config with ``sliding_window`` and no ``layer_types`` (Mistral's) slides on every layer. Qwen2's
    config keeps ``sliding_window`` while ``use_sliding_window`` is off: then no layer slides.
    """
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        return int(window)
    return int(window) if kinds[layer_id] == "sliding_attention" else None


def attention_features(model: Any) -> frozenset[str]:
    """Every optional attention feature (sliding window, soft-cap, sinks, MLA) some layer of the model uses
    (each decoder layer's ``self_attn``)."""
    found: set[str] = set()
    for layer in model.layers:
        found |= layer_features(layer.self_attn)
    return frozenset(found)


def check_backend_features(model: Any, backend: Any, backend_name: str) -> None:
    """A ValueError naming the feature and the backend when the backend cannot serve the model."""
    missing = attention_features(model) - frozenset(getattr(backend, "supported_features", ()))
    if missing:
        raise ValueError(f"the model's attention uses {', '.join(sorted(missing))}, which the {backend_name!r} "
                         f"attention backend does not support; use --attention-backend torch")

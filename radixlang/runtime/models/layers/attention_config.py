"""Per-layer attention options read from a transformers config."""
from __future__ import annotations

from typing import Any


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

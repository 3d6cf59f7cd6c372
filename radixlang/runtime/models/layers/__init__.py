"""Layers the model families share: norms, rotary embeddings, the per-layer attention options read
from a transformers config. A family file (llama.py, qwen3.py, ...) composes them."""

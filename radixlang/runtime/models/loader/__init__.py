"""Checkpoint formats: a Hugging Face folder (sharded safetensors), a hub id (local cache first), a GGUF
file (its header parsed once per start, its config and tokenizer converted into a cached folder, its
tensors streamed one at a time), and random weights from a config (model_loader.py is the entry)."""

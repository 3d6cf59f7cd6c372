"""Multi-LoRA serving: PEFT adapters read from their folders (adapter.py), added to the base model's linears
per batch row (layer.py), registered, loaded and evicted by name (manager.py). docs/lora.md."""

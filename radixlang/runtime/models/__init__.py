"""Model code and weights: one file per family on shared layers, the loaders (HF folder,
GGUF, random weights), CPU weight packing and quantization. May import kernels and torch;
never mem_cache, model_executor, front, scheduler, dp or entrypoints."""

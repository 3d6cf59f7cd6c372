"""Model execution: ``ModelRunner`` (loads the model, sizes the KV pool, runs a forward),
``ForwardBatch`` (what the model and attention backend see), and tensor parallelism
(the leader that broadcasts each step, its followers, the process group). May import
models, mem_cache, sampling and kernels; never front, scheduler, dp or entrypoints."""

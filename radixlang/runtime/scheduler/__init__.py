"""The scheduler: admission with prefix match, the waiting policy, KV slot bookkeeping, grammar compile
waits and grammar steps, chunked prefill, decode, jump-forward, speculative drafts, retraction, stop
conditions, a step's outputs and stats, and the scheduler process entry. May import model_executor,
models, mem_cache, sampling and the runtime's top-level modules; never front, dp or entrypoints."""

"""The serving runtime: requests in, tokens out.

One room per concern (each subpackage's docstring says what it owns and may import):
``server_args`` (the one config), ``sampling/`` (params and the sampler), ``mem_cache/``
(KV pools and per-request KV bookkeeping), ``models/`` (model code, loaders, weight
packing, quantization), ``model_executor/`` (model runner, forward batch, tensor
parallelism), ``scheduler/`` (batching, grammar steps, stop, outputs), ``front/`` (the request
front of the Engine and the server, the detokenizer), ``dp/`` (data-parallel routing) and
``entrypoints/`` (Engine, HTTP server, OpenAI API); ``io_struct`` and ``ipc`` are the wire between
the front and the scheduler.
The import rules between them are checked by tests/test_architecture.py.
"""

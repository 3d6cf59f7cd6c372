"""The request front: one front for the Engine and the server (pending requests, submit / wait / stream,
the router's bookkeeping), the server's TokenizerManager transport over ZMQ, request expansion and output
accumulation, and the detokenizer with its process. Talks to the scheduler only through the messages of
runtime/io_struct.py; may import dp, sampling and the runtime's top-level modules; never the scheduler,
model_executor, models, mem_cache or entrypoints."""

"""KV memory: ``ReqToTokenPool`` and ``TokenToKVPool`` (the paged KV storage) and the
``ReqCache`` protocol that does a request's KV bookkeeping, with the radix tree
(``TreeReqCache``) or without it (``NoReqCache``). May import radix_cache and sampling;
never front, scheduler, model_executor, dp or entrypoints."""

"""Checks of a request against the model that serves it, made when the scheduler admits it."""
from __future__ import annotations

from radixlang.runtime.errors import RequestError
from radixlang.runtime.io_struct import TokenizedGenerateReq


def token_budget(tr: TokenizedGenerateReq, context_len: int) -> int:
    """The output tokens a request may take. An asked-for max_new_tokens past the context left after the prompt
    is refused, as vLLM does (silently decoding until the context is full held a slot for minutes); the default
    (not asked for) is capped to what is left."""
    params = tr.sampling_params
    left = context_len - len(tr.input_ids)
    if params.max_new_tokens is None:
        return min(params.token_budget, left)
    if params.max_new_tokens <= left:
        return params.max_new_tokens
    raise RequestError(f"max_new_tokens is too large: {params.max_new_tokens}. This model's maximum context length "
                       f"is {context_len} tokens and your request has {len(tr.input_ids)} input tokens "
                       f"({params.max_new_tokens} > {context_len} - {len(tr.input_ids)})", "max_new_tokens")

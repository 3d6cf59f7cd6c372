"""Checks of a request against the model that serves it, made when the scheduler admits it."""
from __future__ import annotations

from radixlang.runtime.errors import RequestError
from radixlang.runtime.io_struct import TokenizedGenerateReq
from radixlang.runtime.sampling.sampling_params import SamplingParams


def check_length_left(tr: TokenizedGenerateReq, params: SamplingParams, context_len: int) -> None:
    """An asked-for max_new_tokens past the context left after the prompt is refused, as vLLM does (silently
    decoding until the context is full held a slot for minutes); the default (not asked for) is capped."""
    left = context_len - len(tr.input_ids)
    if params.max_new_tokens <= left:
        return
    if "max_new_tokens" not in (tr.sampling_params or {}):
        params.max_new_tokens = left
        return
    raise RequestError(f"max_new_tokens is too large: {params.max_new_tokens}. This model's maximum context length "
                       f"is {context_len} tokens and your request has {len(tr.input_ids)} input tokens "
                       f"({params.max_new_tokens} > {context_len} - {len(tr.input_ids)})", "max_new_tokens")

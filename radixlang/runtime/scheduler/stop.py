"""When a request is done: length, EOS / stop token ids, stop strings."""
from __future__ import annotations

import re
from typing import Any

from radixlang.runtime.io_struct import FinishReason
from radixlang.runtime.scheduler.batch import Req


def check_finished(req: Req, tokenizer: Any, new_tokens: int = 1) -> FinishReason | None:
    """Why the request ends after its newest ``new_tokens`` tokens, or None to continue."""
    params = req.sampling_params
    if len(req.output_ids) >= params.min_new_tokens:
        for tok in req.output_ids[-new_tokens:]:
            if tok in req.eos_token_ids or tok in params.stop_token_ids:
                return FinishReason.stop(tok)
        if params.stop:
            matched = _match_stop_str(req, tokenizer, new_tokens)
            if matched is not None:
                return FinishReason.stop(matched)
        if params.stop_regex:
            pattern = _match_stop_regex(req, tokenizer)
            if pattern is not None:
                return FinishReason.stop(pattern)
    if len(req.output_ids) >= req.max_new_tokens:
        return FinishReason.max_tokens(req.max_new_tokens)
    return None


def _match_stop_str(req: Req, tokenizer: Any, new_tokens: int) -> str | None:
    # Decode a tail window long enough to hold any stop string (every token yields >= 0 chars,
    # almost always >= 1), plus the previous token so a string spanning the boundary is seen.
    params = req.sampling_params
    window = max(len(s) for s in params.stop) + 1 + new_tokens
    tail = tokenizer.decode(req.output_ids[-window:], skip_special_tokens=params.skip_special_tokens)
    for s in params.stop:
        if s in tail:
            return s
    return None


def _match_stop_regex(req: Req, tokenizer: Any) -> str | None:
    # a regex can match text of any length: search the whole output (only requests with stop_regex pay)
    params = req.sampling_params
    text = tokenizer.decode(req.output_ids, skip_special_tokens=params.skip_special_tokens)
    for pattern in params.stop_regex:
        if re.search(pattern, text):
            return pattern
    return None

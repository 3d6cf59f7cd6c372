"""A constrained request's grammar in a step: its masks for the step's plan (the runner applies them
before sampling), advancing by the chosen token, and jump-forward over text the grammar forces."""
from __future__ import annotations

import logging
from typing import Any

import torch

from radixlang.constrained import GrammarState
from radixlang.kernels.bitmask import allocate_token_bitmask
from radixlang.runtime.io_struct import FinishReason
from radixlang.runtime.scheduler.batch import Req
from radixlang.runtime.scheduler.stop import check_finished

logger = logging.getLogger(__name__)


def grammar_rows(grammar: GrammarState, drafts: list[int], vocab_size: int) -> tuple[torch.Tensor, list[bool]]:
    """The grammar's bitmask for a request's next token and after each of its drafts, [rows, words] int32
    on the CPU (where every backend computes masks), and whether the grammar accepts (may end) at each row.

    The drafts advance a copy of the grammar; the rows stop at the first draft it rejects (that draft's row
    rejects it, so no later row is reached) or after one that ends it."""
    g = grammar.copy() if drafts else grammar
    masks = allocate_token_bitmask(len(drafts) + 1, vocab_size, "cpu")
    accepting: list[bool] = []
    for j in range(len(drafts) + 1):
        g.allowed_token_mask(masks[j])
        accepting.append(g.is_accepting())
        if j == len(drafts) or not g.accept_token(drafts[j]) or g.is_terminated():
            break
    return masks[:len(accepting)], accepting


def advance_grammar(req: Req, tok: int) -> FinishReason | None:
    """Advance the request's grammar by its new token; a finish reason when the grammar ends it."""
    g = req.grammar
    if g is None:
        return None
    if not g.accept_token(tok):  # cannot happen for a token sampled under the mask
        logger.error("request %s sampled token %d outside its grammar", req.rid, tok)
        return FinishReason.abort(f"internal error: token {tok} outside the grammar")
    if g.is_terminated():
        return FinishReason.stop(tok)
    return None


def jump_forward(req: Req, before: GrammarState, tokenizer: Any) -> tuple[FinishReason | None, int]:
    """Append the text the grammar forces after the newest token: (a finish reason if that ends it,
    the number of tokens added).

    The newest token has no KV yet, so it is re-tokenized together with the forced text, the way
    the tokenizer would spell the whole output (``before`` is the grammar state ahead of it); if
    that does not round-trip, the forced text is tokenized alone after it. The appended tokens
    get their KV in the next step, which then runs as an EXTEND for this request; for a request
    that wants logprobs, that extend also scores them (``req.logprob_owed``: the model's logprobs,
    unmasked, as the grammar chose them), so asking for logprobs never changes the tokens.
    """
    g = req.grammar
    if g is None:
        raise RuntimeError(f"jump-forward for request {req.rid}, which has no grammar")
    if g.is_complete():  # only EOS could follow: end now instead of spending a step to sample it
        return FinishReason.stop(None), 0
    forced = g.try_jump_forward()
    room = req.max_new_tokens - len(req.output_ids)
    if not forced or room <= 0:
        return None, 0
    token_bytes = g.compiled.tokenizer_info.token_bytes
    tok = req.output_ids[-1]
    forced_b = forced.encode("utf-8")
    last_b = token_bytes[tok] if 0 <= tok < len(token_bytes) else None
    jumped = None
    if last_b:
        ids = _spell(last_b + forced_b, token_bytes, tokenizer)
        if ids is not None and (h := before.copy()).jump_forward_accept(ids[:room + 1]):
            jumped, replace, ids = h, True, ids[:room + 1]
    if jumped is None:
        ids = _spell(forced_b, token_bytes, tokenizer)
        if ids is None or not (h := g.copy()).jump_forward_accept(ids[:room]):
            return None, 0
        jumped, replace, ids = h, False, ids[:room]
    if replace:
        req.output_ids[-1:] = ids
        added = len(ids) - 1
    else:
        req.output_ids.extend(ids)
        added = len(ids)
    req.grammar = jumped
    req.jump_forward_tokens += added
    if req.return_logprob:
        req.logprob_owed = added
    if jumped.is_complete():
        return FinishReason.stop(None), added
    return check_finished(req, tokenizer, new_tokens=added + 1), added


def _spell(data: bytes, token_bytes: list, tokenizer: Any) -> list[int] | None:
    """The tokenizer's ids for ``data`` (UTF-8 text), or None if they do not spell exactly ``data``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:  # the newest token ends inside a character
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    parts = [token_bytes[t] if 0 <= t < len(token_bytes) else None for t in ids]
    if not ids or any(p is None for p in parts) or b"".join(parts) != data:
        return None
    return ids

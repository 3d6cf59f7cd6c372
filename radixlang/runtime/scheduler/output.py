"""OutputCollector: gathers each step's per-request outputs into one BatchTokenIDOut, a row per request."""
from __future__ import annotations

from typing import NamedTuple

from radixlang.runtime.io_struct import BatchTokenIDOut, FinishReason, TokenRow
from radixlang.runtime.scheduler.batch import Req


class _Refusal(NamedTuple):
    reason: FinishReason
    prompt_tokens: int


class OutputCollector:
    def __init__(self) -> None:
        self._pending: dict[str, tuple[Req | None, bool, _Refusal | None]] = {}

    def add(self, req: Req, *, final: bool) -> None:
        self._pending[req.rid] = (req, final, None)

    def add_error(self, rid: str, message: str, *, prompt_tokens: int, param: str | None = None) -> None:
        """A request refused before it ran (the caller's error: a 400 naming ``param`` over HTTP)."""
        reason = FinishReason.abort(message, status_code=400, param=param or None)
        self._pending[rid] = (None, True, _Refusal(reason, prompt_tokens))

    def flush(self, tokenizer) -> BatchTokenIDOut | None:
        if not self._pending:
            return None
        rows = [self._row(rid, req, final, err) for rid, (req, final, err) in self._pending.items()]
        self._pending.clear()
        return BatchTokenIDOut(rows=rows)

    @staticmethod
    def _row(rid: str, req: Req | None, final: bool, err: _Refusal | None) -> TokenRow:
        if req is None:
            if err is None:
                raise RuntimeError(f"output for request {rid} has neither a request nor a refusal")
            return TokenRow(rid=rid, output_ids=[], finished_reason=err.reason.to_dict(),
                            prompt_tokens=err.prompt_tokens, completion_tokens=0, cached_tokens=0)
        p = req.sampling_params
        start, end = req.sent_output_len, len(req.output_ids)
        if req.return_logprob and not final:  # jumped tokens wait for their logprobs (the next extend)
            end = min(end, len(req.output_token_logprobs))
        reason = req.finished_reason if final else None
        row = TokenRow(rid=rid, output_ids=req.output_ids[start:end],
                       finished_reason=reason.to_dict() if reason is not None else None,
                       prompt_tokens=req.prompt_len, completion_tokens=len(req.output_ids),
                       cached_tokens=req.cached_tokens, skip_special_tokens=p.skip_special_tokens,
                       spaces_between_special_tokens=p.spaces_between_special_tokens, no_stop_trim=p.no_stop_trim,
                       stop_strs=list(p.stop), stop_regexes=list(p.stop_regex), extra_meta=_extra_meta(req),
                       embedding=req.embedding if final else None)
        if req.return_logprob:
            row.output_token_logprobs = req.output_token_logprobs[start:end]
            row.output_top_logprobs = req.output_top_logprobs[start:end] if req.top_logprobs_num else None
            first = not req.sent_input_logprobs
            row.input_token_logprobs = req.input_token_logprobs if first else []
            row.input_top_logprobs = req.input_top_logprobs if first and req.top_logprobs_num else None
            req.sent_input_logprobs = True
        req.sent_output_len = end
        return row


def _extra_meta(req: Req) -> dict[str, int]:
    """meta_info keys only some requests have: jump-forward and speculative-decoding counts."""
    meta = {}
    if req.jump_forward_tokens:
        meta["jump_forward_tokens"] = req.jump_forward_tokens
    if req.spec_draft_tokens:
        meta["spec_draft_tokens"] = req.spec_draft_tokens
        meta["spec_accepted_tokens"] = req.spec_accepted_tokens
    return meta

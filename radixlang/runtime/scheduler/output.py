"""OutputCollector: gathers each step's per-request outputs into one BatchTokenIDOut."""
from __future__ import annotations

from typing import NamedTuple

from radixlang.runtime.io_struct import BatchTokenIDOut, FinishReason
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
        out = BatchTokenIDOut(rids=[], output_ids=[], finished_reasons=[], prompt_tokens=[], completion_tokens=[],
                              cached_tokens=[], skip_special_tokens=[], spaces_between_special_tokens=[],
                              no_stop_trim=[], stop_strs=[])
        for rid, (req, final, err) in self._pending.items():
            out.rids.append(rid)
            if req is None:
                if err is None:
                    raise RuntimeError(f"output for request {rid} has neither a request nor a refusal")
                out.output_ids.append([])
                out.finished_reasons.append(err.reason.to_dict())
                out.prompt_tokens.append(err.prompt_tokens)
                out.completion_tokens.append(0)
                out.cached_tokens.append(0)
                out.skip_special_tokens.append(True)
                out.spaces_between_special_tokens.append(True)
                out.no_stop_trim.append(False)
                out.stop_strs.append([])
                out.stop_regexes.append([])
                out.output_token_logprobs.append(None)
                out.output_top_logprobs.append(None)
                out.input_token_logprobs.append(None)
                out.input_top_logprobs.append(None)
                out.extra_meta.append({})
                out.embeddings.append(None)
                continue
            p = req.sampling_params
            start, end = req.sent_output_len, len(req.output_ids)
            if req.return_logprob and not final:  # jumped tokens wait for their logprobs (the next extend)
                end = min(end, len(req.output_token_logprobs))
            out.output_ids.append(req.output_ids[start:end])
            reason = req.finished_reason if final else None
            out.finished_reasons.append(reason.to_dict() if reason is not None else None)
            out.prompt_tokens.append(req.prompt_len)
            out.completion_tokens.append(len(req.output_ids))
            out.cached_tokens.append(req.cached_tokens)
            out.skip_special_tokens.append(p.skip_special_tokens)
            out.spaces_between_special_tokens.append(p.spaces_between_special_tokens)
            out.no_stop_trim.append(p.no_stop_trim)
            out.stop_strs.append(list(p.stop))
            out.stop_regexes.append(list(p.stop_regex))
            if req.return_logprob:
                out.output_token_logprobs.append(req.output_token_logprobs[start:end])
                out.output_top_logprobs.append(req.output_top_logprobs[start:end] if req.top_logprobs_num else None)
                first = not req.sent_input_logprobs
                out.input_token_logprobs.append(req.input_token_logprobs if first else [])
                out.input_top_logprobs.append(req.input_top_logprobs if first and req.top_logprobs_num else None)
                req.sent_input_logprobs = True
            else:
                out.output_token_logprobs.append(None)
                out.output_top_logprobs.append(None)
                out.input_token_logprobs.append(None)
                out.input_top_logprobs.append(None)
            out.extra_meta.append(_extra_meta(req))
            out.embeddings.append(req.embedding if final else None)
            req.sent_output_len = end
        self._pending.clear()
        return out


def _extra_meta(req: Req) -> dict[str, int]:
    """meta_info keys only some requests have: jump-forward and speculative-decoding counts."""
    meta = {}
    if req.jump_forward_tokens:
        meta["jump_forward_tokens"] = req.jump_forward_tokens
    if req.spec_draft_tokens:
        meta["spec_draft_tokens"] = req.spec_draft_tokens
        meta["spec_accepted_tokens"] = req.spec_accepted_tokens
    return meta

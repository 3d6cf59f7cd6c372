"""The scheduler loop: admit, prefill, decode, finish, retract.

One class serves the in-process Engine and the server's scheduler process.
Each ``step()`` is: pick a batch (prefill if any waiting request fits, else
decode every running request), run it, post-process the sampled tokens, and
return the outputs for the detokenizer.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from radixlang.constrained import Grammar, GrammarCompiler, TokenizerInfo
from radixlang.kernels.attention.base import ForwardMode
from radixlang.kernels.bitmask import allocate_token_bitmask, apply_token_bitmask_inplace
from radixlang.runtime.batch import Req, ScheduleBatch
from radixlang.runtime.config import ServerArgs
from radixlang.runtime.io import BatchTokenIDOut, FlushCacheOut, TokenizedGenerateReq
from radixlang.runtime.latency import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, Histogram
from radixlang.runtime.model_runner import ModelRunner
from radixlang.runtime.req_cache import NoReqCache
from radixlang.runtime.tree_cache import TreeReqCache
from radixlang.runtime.sampling import SamplingInfo, compute_logprobs, sample
from radixlang.runtime.sampling_params import SamplingParams
from radixlang.runtime.schedule_policy import order_waiting
from radixlang.runtime.scheduler_output import OutputCollector
from radixlang.runtime.stop import check_finished

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, server_args: ServerArgs) -> None:
        self.args = server_args.resolve()
        if self.args.device == "cpu" and self.args.num_threads:
            torch.set_num_threads(self.args.num_threads)
        torch.manual_seed(self.args.random_seed)
        self.runner = ModelRunner(self.args)
        self.tokenizer = self.runner.tokenizer
        self.req_to_token_pool = self.runner.req_to_token_pool
        self.kv_pool = self.runner.kv_pool
        self.cache = _make_req_cache(self.args, self.req_to_token_pool, self.kv_pool)
        self.eos_ids = _eos_ids(self.runner.hf_config, self.tokenizer)
        self.generator = torch.Generator().manual_seed(self.args.random_seed)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.outputs = OutputCollector()
        self._grammar_compiler: GrammarCompiler | None = None
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "num_requests": 0,
                      "num_retractions": 0, "forward_steps": 0, "jump_forward_tokens": 0}
        self.jump_forward = not self.args.disable_jump_forward
        self.latency = {"time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
                        "inter_token_latency_seconds": Histogram(ITL_BUCKETS),
                        "e2e_request_latency_seconds": Histogram(E2E_BUCKETS)}

    # ---- requests in ---------------------------------------------------------------------
    def add_request(self, tr: TokenizedGenerateReq) -> None:
        try:
            params = SamplingParams.from_dict(tr.sampling_params)
            self._validate(tr, params)
            future = None
            if params.grammar_key is not None:
                kind, spec = params.grammar_key
                if kind == "ebnf":
                    raise ValueError("ebnf grammars are not supported yet: use regex or json_schema")
                future = self.grammar_compiler.compile_async(kind, spec)
        except ValueError as e:
            self.outputs.add_error(tr.rid, str(e), prompt_tokens=len(tr.input_ids))
            return
        req = Req(rid=tr.rid, origin_input_ids=list(tr.input_ids), sampling_params=params,
                  return_logprob=tr.return_logprob, logprob_start_len=tr.logprob_start_len,
                  top_logprobs_num=tr.top_logprobs_num, stream=tr.stream,
                  eos_token_ids=frozenset() if params.ignore_eos else self.eos_ids, grammar_future=future,
                  arrival_time=time.monotonic())
        self.stats["num_requests"] += 1
        if params.max_new_tokens == 0 and not tr.return_logprob and self.args.disable_radix_cache:
            # a prefill-only request (a client warming a prefix) returns nothing, and without a cache it
            # leaves nothing behind: computing it would only cost a prefill
            req.finished_reason = {"type": "length", "length": 0}
            self._finish(req)
            return
        self.waiting.append(req)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Built on the first constrained request (reading the vocabulary takes a moment)."""
        if self._grammar_compiler is None:
            info = TokenizerInfo.from_tokenizer(self.tokenizer, vocab_size=self.runner.vocab_size,
                                                eos_token_ids=sorted(self.eos_ids))
            self._grammar_compiler = GrammarCompiler(
                info, timeout_s=self.args.grammar_compile_timeout,
                whitespace_pattern=self.args.constrained_json_whitespace_pattern)
        return self._grammar_compiler

    def _poll_grammars(self) -> list:
        """Attach compiled grammars to waiting requests; fail those whose grammar did not compile.

        Returns the futures still compiling.
        """
        pending = []
        for req in list(self.waiting):
            fut = req.grammar_future
            if fut is None or req.grammar is not None:
                continue
            if not fut.done():
                pending.append(fut)
                continue
            try:
                req.grammar = Grammar(fut.result())
            except Exception as e:  # a bad or too slow grammar fails only its own request
                self.waiting.remove(req)
                self.outputs.add_error(req.rid, str(e), prompt_tokens=req.prompt_len)
        return pending

    def _validate(self, tr: TokenizedGenerateReq, params: SamplingParams) -> None:
        if not tr.input_ids:
            raise ValueError("the prompt is empty: give text or input_ids with at least one token")
        bad = [t for t in tr.input_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise ValueError(f"input_ids must be in [0, {self.runner.vocab_size}), got {bad[0]}")
        total = len(tr.input_ids) + params.max_new_tokens
        if len(tr.input_ids) >= self.runner.context_len:
            raise ValueError(f"the prompt has {len(tr.input_ids)} tokens; the context length is "
                             f"{self.runner.context_len}")
        if total > self.runner.context_len:
            params.max_new_tokens = self.runner.context_len - len(tr.input_ids)
        if len(tr.input_ids) + 1 > self.kv_pool.size:
            raise ValueError(f"the prompt has {len(tr.input_ids)} tokens; the KV pool holds {self.kv_pool.size}")
        room = self.kv_pool.size - len(tr.input_ids)
        if params.max_new_tokens > room:  # a lone request past the pool could not be retracted: cap it, as for context
            params.max_new_tokens = room

    def abort_request(self, rid: str) -> None:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finished_reason = {"type": "abort", "message": "aborted by request"}
                self.outputs.add(req, final=True)
                return
        for req in self.running + ([self.chunked_req] if self.chunked_req else []):
            if req.rid == rid and not req.finished:
                req.finished_reason = {"type": "abort", "message": "aborted by request"}

    # ---- the loop ------------------------------------------------------------------------
    def is_idle(self) -> bool:
        return not self.waiting and not self.running and self.chunked_req is None

    def step(self) -> BatchTokenIDOut | None:
        self._reap_aborted()
        compiling = self._poll_grammars()
        batch = self._get_prefill_batch() or self._get_decode_batch()
        if batch is not None:
            self._run_batch(batch)
            self.stats["forward_steps"] += 1
        elif compiling:  # only grammars to wait for: don't spin
            wait_futures(compiling, timeout=0.01, return_when=FIRST_COMPLETED)
        return self.outputs.flush(self.tokenizer)

    def _reap_aborted(self) -> None:
        for req in [r for r in self.running if r.finished]:
            self.running.remove(req)
            self._finish(req)

    # ---- prefill ---------------------------------------------------------------------------
    def _get_prefill_batch(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        budget = self.args.max_prefill_tokens
        chunk = self.args.chunked_prefill_size if self.args.chunked_prefill_size > 0 else 1 << 30
        budget = min(budget, chunk)
        reqs, prefix_lens, extend_lens, sample_mask = [], [], [], []
        if self.chunked_req is not None and self.chunked_req.finished:  # aborted mid-prefill
            self._finish(self.chunked_req)
            self.chunked_req = None
        candidates = ([self.chunked_req] if self.chunked_req else []) + order_waiting(
            self.waiting, self.args.schedule_policy, self.cache)
        self.chunked_req = None
        for req in candidates:
            if req.grammar_future is not None and req.grammar is None:
                continue  # its grammar is still compiling
            if budget <= 0 or len(self.running) + len(reqs) >= self.runner.max_running:
                break
            fresh = req.req_pool_idx is None
            if fresh and reqs and self.cache.should_defer(req, reqs):
                continue  # its shared prefix is being computed in this batch: reuse it next step
            if fresh and not self._admit(req):
                break
            remaining = req.seq_len - req.kv_len
            ext = min(remaining, budget)
            if not self._reserve_extend(req, ext):
                if fresh:
                    self._undo_admit(req)
                else:  # a chunked prefill in progress keeps its slot and goes on next step
                    self.chunked_req = req
                break
            if req in self.waiting:
                self.waiting.remove(req)
            reqs.append(req)
            prefix_lens.append(req.kv_len - ext)
            extend_lens.append(ext)
            last_chunk = ext == remaining
            sample_mask.append(last_chunk)
            budget -= ext
            if not last_chunk:
                self.chunked_req = req
                break
        if not reqs:
            return None
        logger.info("prefill batch: %d seqs, %d new tokens, %d cached tokens, %d running, %d queued, "
                    "kv free %d / %d", len(reqs), sum(extend_lens), sum(prefix_lens), len(self.running),
                    len(self.waiting), self.kv_pool.available_size(), self.kv_pool.size)
        locs = [self.req_to_token_pool.req_to_token[r.req_pool_idx, p:p + e].to(torch.int64)
                for r, p, e in zip(reqs, prefix_lens, extend_lens)]
        return ScheduleBatch(mode=ForwardMode.EXTEND, reqs=reqs, extend_lens=extend_lens, prefix_lens=prefix_lens,
                             out_cache_loc=torch.cat(locs), sample_mask=sample_mask)

    def _admit(self, req: Req) -> bool:
        """Give a waiting request a pool slot and its cached prefix; False if out of room."""
        slots = self.req_to_token_pool.alloc(1)
        if slots is None:
            return False
        req.req_pool_idx = slots[0]
        limit = req.seq_len - 1  # always compute at least one token: its logits are needed
        if req.return_logprob:
            limit = min(limit, req.input_logprob_start)
        prefix, node = self.cache.match(req, limit)
        self.cache.lock(node)
        req.prefix_indices, req.last_node = prefix, node
        n = int(prefix.numel())
        if n:
            self.req_to_token_pool.req_to_token[req.req_pool_idx, :n] = prefix.to(torch.int32)
        req.kv_len = n
        if not req.is_retracted:
            req.cached_tokens = n
        return True

    def _undo_admit(self, req: Req) -> None:
        if req.kv_len == int(req.prefix_indices.numel()):  # nothing of its own computed yet
            self.cache.unlock(req.last_node)
            self.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx, req.last_node, req.kv_len = None, None, 0
            req.prefix_indices = torch.empty(0, dtype=torch.int64)

    def _alloc_kv(self, n: int) -> torch.Tensor | None:
        if self.kv_pool.available_size() < n:
            self.cache.evict(n - self.kv_pool.available_size())
        return self.kv_pool.alloc(n)

    def _reserve_extend(self, req: Req, ext: int) -> bool:
        # keep room for one decode token of every running request so admission never starves decode
        headroom = len(self.running)
        if self.kv_pool.available_size() + self.cache.evictable_size() < ext + headroom:
            return False
        loc = self._alloc_kv(ext)
        if loc is None:
            return False
        self.req_to_token_pool.req_to_token[req.req_pool_idx, req.kv_len:req.kv_len + ext] = loc.to(torch.int32)
        req.kv_len += ext
        return True

    # ---- decode ----------------------------------------------------------------------------
    def _get_decode_batch(self) -> ScheduleBatch | None:
        """Every running request appends its pending tokens: one (decode), or more after a jump-forward.

        When any request has more than one pending token the batch runs as EXTEND (a mixed batch);
        the others ride along as one-token extends.
        """
        if not self.running:
            return None
        while (self.kv_pool.available_size() + self.cache.evictable_size()
               < sum(r.seq_len - r.kv_len for r in self.running)):
            if self.chunked_req is not None:  # a prompt stalled mid-prefill must not starve the decodes
                self._retract_chunked()
            else:
                self._retract_one()
        reqs = list(self.running)
        prefix_lens = [r.kv_len for r in reqs]
        extend_lens = [r.seq_len - r.kv_len for r in reqs]
        loc = self._alloc_kv(sum(extend_lens))
        assert loc is not None
        rows = torch.tensor([r.req_pool_idx for r, e in zip(reqs, extend_lens) for _ in range(e)])
        cols = torch.tensor([p + j for p, e in zip(prefix_lens, extend_lens) for j in range(e)])
        self.req_to_token_pool.req_to_token[rows, cols] = loc.to(torch.int32)
        for r, e in zip(reqs, extend_lens):
            r.kv_len += e
        mode = ForwardMode.DECODE if len(loc) == len(reqs) else ForwardMode.EXTEND
        return ScheduleBatch(mode=mode, reqs=reqs, extend_lens=extend_lens, prefix_lens=prefix_lens,
                             out_cache_loc=loc, sample_mask=[True] * len(reqs), from_running=True)

    def _retract_chunked(self) -> None:
        """Send the half-prefilled request back to the queue; its computed chunks stay in the cache."""
        req, self.chunked_req = self.chunked_req, None
        self._retract(req)
        logger.info("KV pool exhausted: retracted request %s mid-prefill (%d tokens) back to the queue",
                    req.rid, req.prompt_len)

    def _retract_one(self) -> None:
        """Out of KV: send the newest running request back to the queue, keeping its tokens."""
        assert len(self.running) > 1, "a single request cannot fit the KV pool"
        req = self.running.pop()
        self._retract(req)
        logger.info("KV pool exhausted: retracted request %s (%d tokens) back to the queue", req.rid, req.seq_len)

    def _retract(self, req: Req) -> None:
        """Cache what the request computed, free the rest, and put it at the front of the queue."""
        self.cache.cache_unfinished(req)
        self.cache.unlock(req.last_node)
        self.cache.release(req)
        req.is_retracted = True
        self.waiting.insert(0, req)
        self.stats["num_retractions"] += 1

    # ---- run and post-process --------------------------------------------------------------
    def _run_batch(self, batch: ScheduleBatch) -> None:
        rows, logprob_spans = self._logit_rows(batch)
        logits = self.runner.forward(batch, torch.tensor(rows, dtype=torch.int64))
        sample_rows = [i for i, s in enumerate(batch.sample_mask) if s]
        sampling_reqs = [batch.reqs[i] for i in sample_rows]
        last_logits = logits[[logprob_spans[i][1] for i in sample_rows]] if sample_rows else None
        self._record_input_logprobs(batch, logits, logprob_spans)
        if batch.mode is ForwardMode.EXTEND and not batch.from_running:
            self._after_extend(batch)
        if sampling_reqs:
            self._sample_and_append(sampling_reqs, last_logits)
        for req, sampled in zip(batch.reqs, batch.sample_mask):
            if not sampled:
                continue  # a prefill chunk: the request continues next step
            if req.finished:
                if req in self.running:
                    self.running.remove(req)
                self._finish(req)
            elif not batch.from_running:
                self.running.append(req)
                req.is_retracted = False

    def _logit_rows(self, batch: ScheduleBatch) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Token rows whose logits we need, and per request (first_row_idx, last_row_idx, first_pos)."""
        rows: list[int] = []
        spans = []
        offset = 0
        for req, pre, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            first_idx = len(rows)
            first_pos = pre
            if batch.mode is ForwardMode.EXTEND and req.return_logprob:
                # input logprobs: logits at position p score token p + 1 (prompt positions only)
                start = max(req.input_logprob_start, pre)
                end = min(pre + ext, req.prompt_len - 1)
                first_pos = start
                rows.extend(offset + (p - pre) for p in range(start, end))
            rows.append(offset + ext - 1)  # the last token: next-token logits
            spans.append((first_idx, len(rows) - 1, first_pos))
            offset += ext
        return rows, spans

    def _record_input_logprobs(self, batch: ScheduleBatch, logits: torch.Tensor, spans) -> None:
        if batch.mode is not ForwardMode.EXTEND:
            return
        for req, (first, last, first_pos), pre, ext in zip(batch.reqs, spans, batch.prefix_lens, batch.extend_lens):
            if not req.return_logprob:
                continue
            if not req.input_token_logprobs:
                start = req.input_logprob_start
                req.input_token_logprobs.append([None, req.origin_input_ids[start]])
                if req.top_logprobs_num:
                    req.input_top_logprobs.append(None)
            if len(req.input_token_logprobs) >= req.prompt_len - req.input_logprob_start:
                continue  # complete already (a retracted request being recomputed)
            n = max(0, min(pre + ext, req.prompt_len - 1) - first_pos)
            if n == 0:
                continue
            targets = torch.tensor(req.origin_input_ids[first_pos + 1:first_pos + 1 + n], dtype=torch.int64)
            vals, top = compute_logprobs(logits[first:first + n], targets, req.top_logprobs_num)
            req.input_token_logprobs.extend([v, t] for v, t in zip(vals, targets.tolist()))
            if top is not None:
                req.input_top_logprobs.extend([list(p) for p in zip(vs, ids)] for vs, ids in zip(top.values, top.ids))

    def _after_extend(self, batch: ScheduleBatch) -> None:
        # every prefilled prompt (and each chunk of a long one) becomes shareable before it finishes
        for req in batch.reqs:
            self.cache.cache_unfinished(req)

    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        self._apply_grammar_masks(reqs, logits)
        info = SamplingInfo(
            params=[r.sampling_params for r in reqs], output_ids=[r.output_ids for r in reqs],
            # a grammar in an accepting state decides the end itself: banning EOS could leave no token
            min_tokens_blocked=[sorted(r.eos_token_ids | set(r.sampling_params.stop_token_ids))
                                if len(r.output_ids) < r.sampling_params.min_new_tokens
                                and not (r.grammar is not None and r.grammar.is_accepting()) else []
                                for r in reqs])
        want_lp = any(r.return_logprob for r in reqs)
        raw = logits.clone() if want_lp else logits
        if all(r.sampling_params.max_new_tokens == 0 for r in reqs):
            next_ids = None
        else:
            next_ids = sample(logits, info, self.generator)
        now = time.monotonic()
        for i, req in enumerate(reqs):
            if req.finished:
                continue
            if req.sampling_params.max_new_tokens == 0:
                req.finished_reason = {"type": "length", "length": 0}
                continue
            self._observe_token(req, now)
            tok = int(next_ids[i])
            if req.return_logprob:
                vals, top = compute_logprobs(raw[i:i + 1], next_ids[i:i + 1], req.top_logprobs_num)
                req.output_token_logprobs.append([vals[0], tok])
                if top is not None:
                    req.output_top_logprobs.append([list(p) for p in zip(top.values[0], top.ids[0])])
            before = req.grammar.copy() if req.grammar is not None and self._may_jump(req) else None
            req.output_ids.append(tok)
            self.stats["generated_tokens"] += 1
            req.finished_reason = self._grammar_step(req, tok) or check_finished(req, self.tokenizer)
            if before is not None and not req.finished:
                req.finished_reason = self._jump_forward(req, before)
            if req.stream and not req.finished:
                self.outputs.add(req, final=False)

    def _apply_grammar_masks(self, reqs: list[Req], logits: torch.Tensor) -> None:
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.finished]
        if not rows:
            return
        mask = allocate_token_bitmask(len(reqs), logits.shape[-1], logits.device)
        for i in rows:
            reqs[i].grammar.allowed_token_mask(mask[i])
        apply_token_bitmask_inplace(logits, mask, rows)

    def _grammar_step(self, req: Req, tok: int) -> dict[str, Any] | None:
        """Advance the request's grammar by its new token; a finish reason when the grammar ends it."""
        g = req.grammar
        if g is None:
            return None
        if not g.accept_token(tok):  # cannot happen for a token sampled under the mask
            logger.error("request %s sampled token %d outside its grammar", req.rid, tok)
            return {"type": "abort", "message": f"internal error: token {tok} outside the grammar"}
        if g.is_terminated():
            return {"type": "stop", "matched": tok}
        return None

    def _observe_token(self, req: Req, now: float) -> None:
        if req.last_token_time is None:
            self.latency["time_to_first_token_seconds"].observe(now - req.arrival_time)
        else:
            self.latency["inter_token_latency_seconds"].observe(now - req.last_token_time)
        req.last_token_time = now

    # ---- jump-forward ------------------------------------------------------------------------
    def _may_jump(self, req: Req) -> bool:
        # jumped tokens are not sampled, so a request that wants output logprobs decodes every token
        return self.jump_forward and not req.return_logprob

    def _jump_forward(self, req: Req, before: Grammar) -> dict[str, Any] | None:
        """Append the text the grammar forces after the newest token; a finish reason if that ends it.

        The newest token has no KV yet, so it is re-tokenized together with the forced text, the way
        the tokenizer would spell the whole output (``before`` is the grammar state ahead of it); if
        that does not round-trip, the forced text is tokenized alone after it. The appended tokens
        get their KV in the next step, which then runs as an EXTEND for this request.
        """
        g = req.grammar
        if g.is_complete():  # only EOS could follow: end now instead of spending a step to sample it
            return {"type": "stop", "matched": None}
        forced = g.try_jump_forward()
        room = req.sampling_params.max_new_tokens - len(req.output_ids)
        if not forced or room <= 0:
            return None
        token_bytes = g.compiled.tokenizer_info.token_bytes
        tok = req.output_ids[-1]
        forced_b = forced.encode("utf-8")
        last_b = token_bytes[tok] if 0 <= tok < len(token_bytes) else None
        jumped = None
        if last_b:
            ids = self._spell(last_b + forced_b, token_bytes)
            if ids is not None and (h := before.copy()).jump_forward_accept(ids[:room + 1]):
                jumped, replace, ids = h, True, ids[:room + 1]
        if jumped is None:
            ids = self._spell(forced_b, token_bytes)
            if ids is None or not (h := g.copy()).jump_forward_accept(ids[:room]):
                return None
            jumped, replace, ids = h, False, ids[:room]
        if replace:
            req.output_ids[-1:] = ids
            added = len(ids) - 1
        else:
            req.output_ids.extend(ids)
            added = len(ids)
        req.grammar = jumped
        req.jump_forward_tokens += added
        self.stats["jump_forward_tokens"] += added
        self.stats["generated_tokens"] += added
        if jumped.is_complete():
            return {"type": "stop", "matched": None}
        return check_finished(req, self.tokenizer, new_tokens=added + 1)

    def _spell(self, data: bytes, token_bytes: list) -> list[int] | None:
        """The tokenizer's ids for ``data`` (UTF-8 text), or None if they do not spell exactly ``data``."""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:  # the newest token ends inside a character
            return None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        parts = [token_bytes[t] if 0 <= t < len(token_bytes) else None for t in ids]
        if not ids or any(p is None for p in parts) or b"".join(parts) != data:
            return None
        return ids

    def _finish(self, req: Req) -> None:
        if req.req_pool_idx is not None:
            if req.finished_reason and req.finished_reason.get("type") != "abort":
                self.cache.cache_unfinished(req)
            self.cache.unlock(req.last_node)
            self.cache.release(req)
        self.stats["prompt_tokens"] += req.prompt_len
        self.stats["cached_tokens"] += req.cached_tokens
        self.latency["e2e_request_latency_seconds"].observe(time.monotonic() - req.arrival_time)
        self.outputs.add(req, final=True)

    # ---- maintenance -----------------------------------------------------------------------
    def flush_cache(self) -> FlushCacheOut:
        if not self.is_idle():
            return FlushCacheOut(success=False, message=f"cannot flush the cache while {len(self.running)} "
                                                        f"requests run and {len(self.waiting)} wait")
        self.cache.reset()
        self.check_memory_leak()
        return FlushCacheOut(success=True, message="cache flushed")

    def check_memory_leak(self) -> None:
        """When idle: every KV slot is free or held by the prefix cache, and no request slot is held."""
        if not self.is_idle():
            return
        free, cached = self.kv_pool.available_size(), self.cache.cached_size()
        req_free = self.req_to_token_pool.available_size()
        if free + cached != self.kv_pool.size or req_free != self.req_to_token_pool.size:
            msg = (f"memory leak detected: free {free} + cached {cached} != total {self.kv_pool.size} KV slots, "
                   f"or req slots free {req_free} != {self.req_to_token_pool.size}")
            logger.error(msg)
            raise AssertionError(msg)

    def get_internal_state(self) -> dict[str, Any]:
        s = self.stats
        return {
            "memory": {"kv_total_tokens": self.kv_pool.size, "kv_free_tokens": self.kv_pool.available_size(),
                       "kv_cached_tokens": self.cache.cached_size(),
                       "kv_evictable_tokens": self.cache.evictable_size(),
                       "kv_protected_tokens": self.cache.protected_size()},
            "cache_hit_rate": (s["cached_tokens"] / s["prompt_tokens"]) if s["prompt_tokens"] else 0.0,
            "num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
            "context_length": self.runner.context_len, "vocab_size": self.runner.vocab_size,
            "latency": {name: h.to_dict() for name, h in self.latency.items()},
            **s,
        }


def _make_req_cache(args: ServerArgs, req_pool, kv_pool):
    if args.disable_radix_cache:
        return NoReqCache(req_pool, kv_pool)
    return TreeReqCache(req_pool, kv_pool, page_size=args.page_size)


def _eos_ids(hf_config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)

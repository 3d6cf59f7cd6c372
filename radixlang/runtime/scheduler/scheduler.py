"""The scheduler loop: admit, prefill, decode, finish, retract.

One class serves the in-process Engine and the server's scheduler process.
Each ``step()`` is: pick a batch (prefill if any waiting request fits, else
decode every running request) and its plan (``step_plan``), have the runner execute
it (forward, masks, sampling, logprobs: token ids back), do the bookkeeping of the
chosen tokens, and return the outputs for the detokenizer. It runs no model code
and no sampling math.

Its parts live beside it: ``kv_slots`` (a request's KV slots: admit, reserve, release),
``grammar_wait`` (grammars compiling off the loop), ``grammar_step`` (masks, jump-forward),
``stop`` (finish conditions), ``scheduler_output`` (what a step sends), ``scheduler_stats``
(counters, latency, the leak check). The runner is anything that satisfies
``model_executor.runner.Runner``.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from radixlang.constrained import GrammarCompiler
from radixlang.kernels.attention.base import ForwardMode
from radixlang.runtime.errors import RequestError
from radixlang.runtime.scheduler.grammar_step import advance_grammar, jump_forward
from radixlang.runtime.scheduler.grammar_wait import GrammarWaits
from radixlang.runtime.scheduler.input_logprobs import logit_rows, record_input_logprobs, record_jump_logprobs
from radixlang.runtime.io_struct import (BatchTokenIDOut, FinishReason, FlushCacheOut, LoRAUpdateOut,
                                         LoRAUpdateReq, SchedulerReady, TokenizedGenerateReq, check_embedding_match)
from radixlang.runtime.scheduler.kv_slots import KVSlots
from radixlang.runtime.scheduler.lora_batch import BatchAdapters, cache_namespace
from radixlang.runtime.scheduler.pooled_step import add_pooled, pooled_rows
from radixlang.runtime.scheduler.request_checks import token_budget
from radixlang.runtime.scheduler.batch import Req, ScheduleBatch
from radixlang.runtime.scheduler.policy import order_waiting
from radixlang.runtime.scheduler.speculative import make_drafter
from radixlang.runtime.scheduler.step_plan import build_plan
from radixlang.runtime.scheduler.output import OutputCollector
from radixlang.runtime.scheduler.stats import SchedulerStats, find_memory_leak
from radixlang.runtime.scheduler.stop import check_finished
from radixlang.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixlang.runtime.mem_cache.req_cache import NoReqCache, ReqCache
from radixlang.runtime.mem_cache.swa_memory_pool import SWATokenToKVPool
from radixlang.runtime.mem_cache.swa_req_cache import SWANoReqCache, SWATreeReqCache
from radixlang.runtime.mem_cache.tree_req_cache import TreeReqCache
from radixlang.runtime.model_executor.pooling import PooledRows, PoolingConfig, read_pooling_config
from radixlang.runtime.model_executor.runner import Runner
from radixlang.runtime.sampling.step_io import StepOutput, StepPlan, TopRow, UnmaskedRow
from radixlang.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


class Scheduler:
    """One replica's scheduling loop over a runner: anything that satisfies ``model_executor.runner.Runner``
    (a ``ModelRunner``, built with its scheduler by ``scheduler/build.py``; tests pass a scripted one).
    It decides each step's batch and plan; the runner executes it and returns token ids.
    """

    def __init__(self, server_args: ServerArgs, *, runner: Runner) -> None:
        self.args = server_args.resolve()
        self.runner = runner
        self.tokenizer = self.runner.tokenizer
        self.req_to_token_pool = self.runner.req_to_token_pool
        self.kv_pool = self.runner.kv_pool
        self.cache = _make_req_cache(self.args, self.req_to_token_pool, self.kv_pool)
        self.kv = KVSlots(self.req_to_token_pool, self.kv_pool, self.cache)
        self.eos_ids = _eos_ids(self.runner.hf_config, self.tokenizer)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.outputs = OutputCollector()
        self.grammars = GrammarWaits(tokenizer=self.tokenizer, vocab_size=self.runner.vocab_size,
                                     eos_ids=self.eos_ids, timeout_s=self.args.grammar_compile_timeout,
                                     whitespace_pattern=self.args.constrained_json_whitespace_pattern,
                                     backend=self.args.grammar_backend)
        self.metrics = SchedulerStats()
        self.stats = self.metrics.counts
        self.jump_forward = not self.args.disable_jump_forward
        self.drafter = make_drafter(self.args, vocab_size=self.runner.vocab_size, context_len=self.runner.context_len)
        # an embedding server pools final hidden states (pooled_step.py) and samples nothing
        self.pooling: PoolingConfig | None = (read_pooling_config(self.runner.model_dir) if self.args.is_embedding
                                              else None)
        self.adapters = BatchAdapters(self.runner.lora, max_per_batch=self.args.max_loras_per_batch)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The grammar compiler of this replica (built on first use)."""
        return self.grammars.compiler

    # ---- requests in ---------------------------------------------------------------------
    def add_request(self, tr: TokenizedGenerateReq) -> None:
        params = tr.sampling_params
        try:
            budget = self._validate(tr)
            future = self.grammars.submit(params)
        except ValueError as e:  # a RequestError, or a grammar the compiler refused
            self.outputs.add_error(tr.rid, str(e), prompt_tokens=len(tr.input_ids), param=getattr(e, "param", None))
            return
        lora_id = self.adapters.id_of(tr.lora_name)
        req = Req(rid=tr.rid, origin_input_ids=list(tr.input_ids), sampling_params=params, max_new_tokens=budget,
                  return_logprob=tr.return_logprob, logprob_start_len=tr.logprob_start_len,
                  top_logprobs_num=tr.top_logprobs_num, stream=tr.stream,
                  eos_token_ids=frozenset() if params.ignore_eos else self.eos_ids, grammar_future=future,
                  arrival_time=time.monotonic(), lora_id=lora_id,
                  cache_namespace=cache_namespace(self.runner.rope_length_key(len(tr.input_ids)), lora_id))
        if self.pooling is not None:
            req.pooled = PooledRows(positions=self.pooling.positions(req.prompt_len),
                                    dimensions=tr.embedding_dimensions)
        self.stats["num_requests"] += 1
        if budget == 0 and not tr.return_logprob and req.pooled is None and self.args.disable_radix_cache:
            # a prefill-only request (a client warming a prefix) returns nothing, and without a cache it
            # leaves nothing behind: computing it would only cost a prefill
            req.finished_reason = FinishReason.max_tokens(0)
            self._finish(req)
            return
        self.waiting.append(req)

    def _validate(self, tr: TokenizedGenerateReq) -> int:
        """Checks against this model and pool; the request's token budget."""
        vocab_size, context_len = self.runner.vocab_size, self.runner.context_len
        if not tr.input_ids:
            raise RequestError("the prompt is empty: give text or input_ids with at least one token", "input_ids")
        bad = [t for t in tr.input_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"input_ids must be in [0, {vocab_size}), got {bad[0]}", "input_ids")
        _validate_request_extras(tr, vocab_size)
        self._validate_embedding(tr)
        self.adapters.check(tr.lora_name)
        if len(tr.input_ids) >= context_len:
            raise RequestError(f"the prompt has {len(tr.input_ids)} tokens; the context length is "
                               f"{context_len}", "input_ids")
        budget = token_budget(tr, context_len)
        if len(tr.input_ids) + 1 > self.kv_pool.size:
            raise RequestError(f"the prompt has {len(tr.input_ids)} tokens; the KV pool holds {self.kv_pool.size}",
                               "input_ids")
        # a lone request past the pool could not be retracted: cap it, as for context
        return min(budget, self.kv_pool.size - len(tr.input_ids))

    def _validate_embedding(self, tr: TokenizedGenerateReq) -> None:
        """An embedding server serves embedding requests only, and a generation server none."""
        check_embedding_match(embedding=tr.embedding, is_embedding=self.pooling is not None,
                              model=self.args.served_model_name)
        if self.pooling is not None:
            self.pooling.check_dimensions(tr.embedding_dimensions, int(self.runner.hf_config.hidden_size))

    def abort_request(self, rid: str) -> None:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finished_reason = FinishReason.abort("aborted by request")
                self.outputs.add(req, final=True)
                return
        for req in self.running + ([self.chunked_req] if self.chunked_req else []):
            if req.rid == rid and not req.finished:  # freed by the next step (_reap_aborted)
                req.finished_reason = FinishReason.abort("aborted by request")

    # ---- the loop ------------------------------------------------------------------------
    def ready_report(self, replica: int) -> SchedulerReady:
        """What this replica tells the request front once it is built (the same from a process or a thread)."""
        runner = self.runner
        return SchedulerReady(replica=replica, pid=os.getpid(), server_args=self.args.to_dict(),
                              model_path=runner.model_path, tokenizer_path=runner.tokenizer_path,
                              kv_pool_size=self.kv_pool.size, model_dir=runner.model_dir,
                              lora_adapters=self.adapters.listed())

    def is_idle(self) -> bool:
        return not self.waiting and not self.running and self.chunked_req is None

    def step(self) -> BatchTokenIDOut | None:
        self._reap_aborted()
        compiling = self.grammars.poll(self.waiting, self.outputs)
        batch = self._get_prefill_batch() or self._get_decode_batch()
        if batch is not None:
            self._run_batch(batch)
            self.stats["forward_steps"] += 1
        elif compiling:  # only grammars to wait for: don't spin
            self.grammars.wait(compiling)
        return self.outputs.flush(self.tokenizer)

    def _reap_aborted(self) -> None:
        for req in [r for r in self.running if r.finished]:
            self.running.remove(req)
            self._finish(req)
        if self.chunked_req is not None and self.chunked_req.finished:  # aborted mid-prefill
            self._finish(self.chunked_req)
            self.chunked_req = None

    # ---- prefill ---------------------------------------------------------------------------
    def _get_prefill_batch(self) -> ScheduleBatch | None:
        """Admit waiting requests (the chunked prefill in progress first) under the token budget."""
        if not self.waiting and self.chunked_req is None:
            return None
        budget = self.args.max_prefill_tokens
        if self.args.chunked_prefill_size > 0:
            budget = min(budget, self.args.chunked_prefill_size)
        reqs: list[Req] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        sample_mask: list[bool] = []
        candidates = ([self.chunked_req] if self.chunked_req else []) + order_waiting(
            self.waiting, self.args.schedule_policy, self.cache)
        self.chunked_req = None
        for req in candidates:
            if self.grammars.is_compiling(req):
                continue
            if budget <= 0 or len(self.running) + len(reqs) >= self.runner.max_running:
                break
            fresh = req.req_pool_idx is None
            if fresh and reqs and self.cache.should_defer(req, reqs):
                continue  # its shared prefix is being computed in this batch: reuse it next step
            if not self.adapters.admit(req, self.running, reqs):
                continue  # its adapter would pass max_loras_per_batch, or cannot be loaded yet: a later step
            if fresh and not self.kv.admit(req):
                break
            remaining = req.seq_len - req.kv_len
            ext = min(remaining, budget)
            if not self.kv.reserve_extend(req, ext, headroom=len(self.running)):
                if fresh:
                    self.kv.undo_admit(req)
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
        return ScheduleBatch(mode=ForwardMode.EXTEND, reqs=reqs, extend_lens=extend_lens, prefix_lens=prefix_lens,
                             out_cache_loc=self.kv.extend_locs(reqs, prefix_lens, extend_lens),
                             sample_mask=sample_mask)

    # ---- decode ----------------------------------------------------------------------------
    def _get_decode_batch(self) -> ScheduleBatch | None:
        """Every running request appends its pending tokens: one (decode), or more after a jump-forward.

        When any request has more than one pending token the batch runs as EXTEND (a mixed batch);
        the others ride along as one-token extends.
        """
        if not self.running:
            return None
        self._retract_until_decode_fits()
        reqs = list(self.running)
        prefix_lens = [r.kv_len for r in reqs]
        extend_lens = [r.seq_len - r.kv_len for r in reqs]
        drafts = None
        if self.drafter is not None:  # speculative: drafts ride after the pending tokens, in the room left
            drafts = self.drafter.drafts(reqs, self.kv.room() - sum(extend_lens))
            if any(drafts):
                extend_lens = [e + len(d) for e, d in zip(extend_lens, drafts)]
            else:
                drafts = None
        loc = self.kv.reserve_pending(reqs, drafts)
        mode = ForwardMode.DECODE if len(loc) == len(reqs) else ForwardMode.EXTEND
        return ScheduleBatch(mode=mode, reqs=reqs, extend_lens=extend_lens, prefix_lens=prefix_lens,
                             out_cache_loc=loc, sample_mask=[True] * len(reqs), from_running=True, drafts=drafts)

    def _retract_until_decode_fits(self) -> None:
        while self.kv.room() < sum(r.seq_len - r.kv_len for r in self.running):
            if self.chunked_req is not None:  # a prompt stalled mid-prefill must not starve the decodes
                self._retract_chunked()
            else:
                self._retract_one()

    def _retract_chunked(self) -> None:
        """Send the half-prefilled request back to the queue; its computed chunks stay in the cache."""
        req, self.chunked_req = self.chunked_req, None
        if req is None:
            raise RuntimeError("no chunked prefill to retract")
        self._retract(req)
        logger.info("KV pool exhausted: retracted request %s mid-prefill (%d tokens) back to the queue",
                    req.rid, req.prompt_len)

    def _retract_one(self) -> None:
        """Out of KV: send the newest running request back to the queue, keeping its tokens."""
        if len(self.running) <= 1:  # _validate caps a request to the pool, so a lone one always fits
            raise RuntimeError(f"out of KV with {len(self.running)} running request(s): a single request "
                               f"cannot fit the KV pool ({self.kv_pool.size} slots)")
        req = self.running.pop()
        self._retract(req)
        logger.info("KV pool exhausted: retracted request %s (%d tokens) back to the queue", req.rid, req.seq_len)

    def _retract(self, req: Req) -> None:
        """Cache what the request computed, free the rest, and put it at the front of the queue."""
        self.kv.release(req, keep=True)
        if self.drafter is not None:
            self.drafter.release(req)
        req.is_retracted = True
        if req.pooled is not None:  # its rows are pooled again when its prefill runs again
            req.pooled.total = None
        self.waiting.insert(0, req)
        self.stats["num_retractions"] += 1

    # ---- run and post-process --------------------------------------------------------------
    def _run_batch(self, batch: ScheduleBatch) -> None:
        if self.pooling is not None:
            self._run_pooled_batch(batch, self.pooling)
            return
        rows, logprob_spans = logit_rows(batch)
        plan = build_plan(batch, logprob_spans, vocab_size=self.runner.vocab_size)
        out = self.runner.execute(batch.step_inputs(rows), plan)
        record_input_logprobs(batch, plan, out)
        record_jump_logprobs(batch, plan, out)
        if batch.mode is ForwardMode.EXTEND and not batch.from_running:
            self._after_extend(batch)
        if batch.drafts is not None:
            self._append_verified(batch, out)
        else:
            self._append_sampled(batch, out)
        self._update_running(batch)
        self.kv.trim_windows(self.running)

    def _run_pooled_batch(self, batch: ScheduleBatch, pooling: PoolingConfig) -> None:
        """An embedding server's prefill: the runner returns the pooled rows' hidden states; a request
        whose last chunk ran finishes with its embedding."""
        rows, spans = pooled_rows(batch)
        hidden = self.runner.execute(batch.step_inputs(rows), StepPlan(reqs=[])).hidden
        if hidden is None:
            raise RuntimeError("the runner of an embedding server returned no hidden states")
        add_pooled(batch, hidden, spans, pooling)
        self._after_extend(batch)
        for req, last_chunk in zip(batch.reqs, batch.sample_mask):
            if last_chunk and not req.finished:
                req.finished_reason = FinishReason.stop(None)
                self._finish(req)

    def _after_extend(self, batch: ScheduleBatch) -> None:
        # every prefilled prompt (and each chunk of a long one) becomes shareable before it finishes
        for req in batch.reqs:
            self.cache.cache_unfinished(req)

    def _update_running(self, batch: ScheduleBatch) -> None:
        """Finished requests leave; a prefilled request that goes on joins the running list."""
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

    def _append_sampled(self, batch: ScheduleBatch, out: StepOutput) -> None:
        """Each request that sampled appends its token (none chosen: max_new_tokens 0 ends it)."""
        now = time.monotonic()
        for req, sampled, ro in zip(batch.reqs, batch.sample_mask, out.reqs):
            if not sampled or req.finished:
                continue
            if not ro.tokens or req.max_new_tokens == 0:
                req.finished_reason = FinishReason.max_tokens(0)
                continue
            self.metrics.observe_token(req, now)
            self._append_token(req, ro.tokens[0], logprob=ro.token_logprob(0),
                               unmasked=ro.unmasked[0] if ro.unmasked else None)
            if req.stream and not req.finished:
                self.outputs.add(req, final=False)

    def _append_verified(self, batch: ScheduleBatch, out: StepOutput) -> None:
        """Speculative decoding: each request appends the drafts the runner kept, then its own token, while
        none ends it or jumps forward; the rejected drafts' KV slots are freed."""
        now = time.monotonic()
        for req, d, ro in zip(batch.reqs, batch.drafts or [], out.reqs):
            accepted = 0
            for j, tok in enumerate(ro.tokens if not req.finished else []):
                draft = d[j] if j < len(d) else None
                self.metrics.observe_token(req, now)
                before = len(req.output_ids)
                self._append_token(req, tok, logprob=ro.token_logprob(j),
                                   unmasked=ro.unmasked[j] if j < len(ro.unmasked) else None)
                if tok != draft or req.finished or len(req.output_ids) != before + 1:  # a jump-forward
                    break
                accepted += 1
            self.kv.settle_drafts(req, len(d), accepted)
            if self.drafter is not None:
                self.drafter.settle(req, len(d), accepted)
            req.spec_draft_tokens += len(d)
            req.spec_accepted_tokens += accepted
            self.stats["spec_draft_tokens"] += len(d)
            self.stats["spec_accepted_tokens"] += accepted
            if req.stream and not req.finished:
                self.outputs.add(req, final=False)

    def _append_token(self, req: Req, tok: int, *, logprob: tuple[float, TopRow | None] | None = None,
                      unmasked: UnmaskedRow | None = None) -> None:
        """Append the chosen token, advance the grammar (and jump forward), and decide if it ends the request.

        ``logprob``: the token's logprob (and top_k) from the masked row it was chosen from, for a request
        that wants logprobs; ``unmasked``: that row before the grammar mask. A jump-forward may respell the
        token with the forced text: the token that stays was forced, not sampled, and gets its unmasked
        logprob, as the jumped tokens do. Those come from the next step's extend, which computes their KV, so
        asking for logprobs never changes the tokens; a finish the jump reached waits for that step.
        """
        n = len(req.output_ids)
        before = req.grammar.copy() if req.grammar is not None and self.jump_forward else None
        req.output_ids.append(tok)
        self.stats["generated_tokens"] += 1
        req.finished_reason = advance_grammar(req, tok) or check_finished(req, self.tokenizer)
        if before is not None and not req.finished:
            req.finished_reason, added = jump_forward(req, before, self.tokenizer)
            self.stats["jump_forward_tokens"] += added
            self.stats["generated_tokens"] += added
        if logprob is not None:
            kept = req.output_ids[n]
            if kept != tok and unmasked is not None:
                logprob = unmasked.logprob(kept)
            value, top = logprob
            req.output_token_logprobs.append([value, kept])
            if top is not None:
                req.output_top_logprobs.append(top)
        if req.logprob_owed and req.finished_reason is not None and not req.finished_reason.is_abort:
            req.finish_after_logprobs, req.finished_reason = req.finished_reason, None

    def _finish(self, req: Req) -> None:
        self.kv.release(req, keep=req.finished_reason is not None and not req.finished_reason.is_abort)
        if self.drafter is not None:
            self.drafter.release(req)
        self.metrics.observe_finish(req)
        self.outputs.add(req, final=True)

    # ---- maintenance -----------------------------------------------------------------------
    def flush_cache(self) -> FlushCacheOut:
        if not self.is_idle():
            return FlushCacheOut(success=False, message=f"cannot flush the cache while {len(self.running)} "
                                                        f"requests run and {len(self.waiting)} wait")
        self.cache.reset()
        self.check_memory_leak()
        return FlushCacheOut(success=True, message="cache flushed")

    def update_lora(self, msg: LoRAUpdateReq) -> LoRAUpdateOut:
        """Load (msg.path given) or unload an adapter by name."""
        return self.adapters.update(msg)

    def check_memory_leak(self) -> None:
        """When idle: raise RuntimeError unless every KV slot is free or cached and no request slot is held."""
        if not self.is_idle():
            return
        leak = find_memory_leak(self.kv_pool, self.req_to_token_pool, self.cache)
        if leak is None and self.drafter is not None:
            leak = self.drafter.find_leak()
        if leak is not None:
            logger.error(leak)
            raise RuntimeError(leak)

    def get_internal_state(self) -> dict[str, Any]:
        state = self.metrics.internal_state(kv_pool=self.kv_pool, cache=self.cache, num_running=len(self.running),
                                            num_waiting=len(self.waiting), context_len=self.runner.context_len,
                                            vocab_size=self.runner.vocab_size)
        if self.adapters.manager is not None:
            state["lora"] = self.adapters.manager.state()
        return state


def _make_req_cache(args: ServerArgs, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool) -> ReqCache:
    if isinstance(kv_pool, SWATokenToKVPool):  # window layers in their own slot space: trim and tombstone
        if args.disable_radix_cache:
            return SWANoReqCache(req_pool, kv_pool)
        return SWATreeReqCache(req_pool, kv_pool, page_size=args.page_size)
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


def _validate_request_extras(tr: TokenizedGenerateReq, vocab_size: int) -> None:
    """Checks that need the prompt length or the vocabulary: logprob_start_len, logit_bias ids."""
    if tr.return_logprob and tr.logprob_start_len >= len(tr.input_ids):
        raise RequestError(f"logprob_start_len must be < the prompt's {len(tr.input_ids)} tokens, got "
                           f"{tr.logprob_start_len}", "logprob_start_len")
    bad = [t for t, _ in tr.sampling_params.logit_bias_ids if t >= vocab_size]
    if bad:
        raise RequestError(f"logit_bias token ids must be in [0, {vocab_size}), got {bad[0]}", "logit_bias")


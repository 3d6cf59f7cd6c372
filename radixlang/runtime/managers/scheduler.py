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
from radixlang.runtime.managers.schedule_batch import Req, ScheduleBatch
from radixlang.runtime.errors import RequestError
from radixlang.runtime.server_args import ServerArgs
from radixlang.runtime.managers.io_struct import BatchTokenIDOut, FlushCacheOut, TokenizedGenerateReq
from radixlang.runtime.managers.latency import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, Histogram
from radixlang.runtime.model_executor.model_runner import ModelRunner
from radixlang.runtime.mem_cache.req_cache import NoReqCache
from radixlang.runtime.mem_cache.tree_req_cache import TreeReqCache
from radixlang.runtime.sampling.sampler import SamplingInfo, compute_logprobs, sample
from radixlang.runtime.managers.grammar_step import advance_grammar, apply_grammar_masks, jump_forward
from radixlang.runtime.managers.input_logprobs import logit_rows, record_input_logprobs
from radixlang.runtime.sampling.sampling_params import SamplingParams
from radixlang.runtime.managers.schedule_policy import order_waiting
from radixlang.runtime.managers.scheduler_output import OutputCollector
from radixlang.runtime.managers.stop import check_finished

logger = logging.getLogger(__name__)


class Scheduler:
    """One replica's scheduling loop over a model runner.

    ``runner`` is built from the args when not given; tests pass a scripted one (anything with
    the ``ModelRunner`` attributes the scheduler reads: ``forward(StepInputs) -> logits``, the
    pools, ``tokenizer``, ``hf_config``, ``vocab_size``, ``context_len``, ``max_running``).
    """

    def __init__(self, server_args: ServerArgs, *, runner: ModelRunner | None = None) -> None:
        self.args = server_args.resolve()
        if self.args.device == "cpu" and self.args.num_threads:
            torch.set_num_threads(self.args.num_threads)
        torch.manual_seed(self.args.random_seed)
        self.runner = runner if runner is not None else ModelRunner(self.args)
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
                    raise RequestError("ebnf grammars are not supported yet: use regex or json_schema", "ebnf")
                future = self.grammar_compiler.compile_async(kind, spec)
        except ValueError as e:  # a RequestError, or a grammar the compiler refused
            self.outputs.add_error(tr.rid, str(e), prompt_tokens=len(tr.input_ids), param=getattr(e, "param", None))
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
            raise RequestError("the prompt is empty: give text or input_ids with at least one token", "input_ids")
        bad = [t for t in tr.input_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise RequestError(f"input_ids must be in [0, {self.runner.vocab_size}), got {bad[0]}", "input_ids")
        total = len(tr.input_ids) + params.max_new_tokens
        if len(tr.input_ids) >= self.runner.context_len:
            raise RequestError(f"the prompt has {len(tr.input_ids)} tokens; the context length is "
                               f"{self.runner.context_len}", "input_ids")
        if total > self.runner.context_len:
            params.max_new_tokens = self.runner.context_len - len(tr.input_ids)
        if len(tr.input_ids) + 1 > self.kv_pool.size:
            raise RequestError(f"the prompt has {len(tr.input_ids)} tokens; the KV pool holds {self.kv_pool.size}",
                               "input_ids")
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
        rows, logprob_spans = logit_rows(batch)
        logits = self.runner.forward(batch.step_inputs(torch.tensor(rows, dtype=torch.int64)))
        sample_rows = [i for i, s in enumerate(batch.sample_mask) if s]
        sampling_reqs = [batch.reqs[i] for i in sample_rows]
        last_logits = logits[[logprob_spans[i][1] for i in sample_rows]] if sample_rows else None
        record_input_logprobs(batch, logits, logprob_spans)
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

    def _after_extend(self, batch: ScheduleBatch) -> None:
        # every prefilled prompt (and each chunk of a long one) becomes shareable before it finishes
        for req in batch.reqs:
            self.cache.cache_unfinished(req)

    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        apply_grammar_masks(reqs, logits)
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
            req.finished_reason = advance_grammar(req, tok) or check_finished(req, self.tokenizer)
            if before is not None and not req.finished:
                req.finished_reason, added = jump_forward(req, before, self.tokenizer)
                self.stats["jump_forward_tokens"] += added
                self.stats["generated_tokens"] += added
            if req.stream and not req.finished:
                self.outputs.add(req, final=False)

    def _observe_token(self, req: Req, now: float) -> None:
        if req.last_token_time is None:
            self.latency["time_to_first_token_seconds"].observe(now - req.arrival_time)
        else:
            self.latency["inter_token_latency_seconds"].observe(now - req.last_token_time)
        req.last_token_time = now

    def _may_jump(self, req: Req) -> bool:
        # jumped tokens are not sampled, so a request that wants output logprobs decodes every token
        return self.jump_forward and not req.return_logprob

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

"""Torch attention backend: the reference every other backend is compared with; runs on the CPU.

Cascade over shared prefixes: requests whose KV rows begin with the same pool slots (the radix cache
hands every request of a few-shot batch, a system prompt or a fork the same slots for the common
part) form a group. The group gathers the shared run's k/v once and scores every query of the group
against it in one matmul per kv head; each request gathers and scores only its own tail. One softmax
runs over both parts, so the result is exact attention, without gathering the shared prefix once
per request. This is what decodes (and one-token or short extends) use; on a batch behind a
few-shot prefix it is much faster than gathering each request's whole context (docs/cpu.md).

Requests that share nothing run as one padded group (decode) or, for multi-token extends, one causal
SDPA each over prefix + new tokens; a fresh prompt attends over its own new k/v, with no gather.

Layers with a sliding window, attention-logit soft-capping or attention sinks (``layer_features``) run a
plain path instead: each request's scores over its whole cached context, masked by position, capped,
and softmaxed with the sink logits as extra columns. That path is the reference for those features.

Multi-head latent attention (``mla`` layers, DeepSeek-V2/V3) is multi-query attention over the cached
latent: every query head scores the one latent row per token, and the value is that row's leading
features. Extends run one request at a time (the query heads and tokens of a request in one matmul);
a decode batch runs as one batched matmul over the contexts padded to the longest.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlang.kernels.attention.base import (AttentionBackend, AttentionLayerLike, ForwardBatchLike,
                                              layer_features)

MIN_SHARED = 16  # a shared run shorter than this is not worth its own group
MAX_GROUPED_EXTEND = 64  # longer extends run one flash SDPA each (padding a group to them would cost more)
# torch's CPU flash-attention kernel, which also returns each query's log-sum-exp (what merging two
# partial attentions needs); private, so looked up once and optional
_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass
class _Group:
    """Requests attended together: queries padded to [n, e_max], keys = shared run + each one's own tail."""
    members: list[int]  # batch indices
    q_rows: torch.Tensor | None  # [n * e_max] int64 rows of q (padding repeats a valid row); None = all rows
    out_rows: torch.Tensor | None  # rows of the output the valid queries go to; None = all rows in order
    valid: torch.Tensor | None  # [n * e_max] bool: which padded queries are real; None = all
    e_max: int
    shared_loc: torch.Tensor | None  # [L] int64 KV slots every member starts with
    own_loc: torch.Tensor  # [n, S] int64 each member's slots after the shared run (padding -> slot 0)
    own_mask: torch.Tensor | None  # [n, e_max, S] bool: the own keys each query sees; None = all
    own_bias: torch.Tensor | None = None  # own_mask as an additive float mask [n, 1, e_max, S] (flash path)


class TorchNativeAttnBackend(AttentionBackend):
    supported_features = frozenset({"sliding_window", "logit_softcap", "sinks", "mla"})

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, **_: object) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = device
        self.dtype = dtype
        self._groups: list[_Group] = []
        # multi-token extends outside any group: (first token row, extend_len, kv slots or None = own k/v, mask)
        self._extend_reqs: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = []
        # the plain path's per-request (first token row, new tokens, kv slots [total] int64, query positions)
        self._plain_reqs: list[tuple[int, int, torch.Tensor, torch.Tensor]] | None = None
        # an MLA decode's padded contexts, built from (and valid with) that _plain_reqs list:
        # (the list, slots [bs, S] int64, key visible [bs, 1, S] bool)
        self._mla_pad: tuple[list, torch.Tensor, torch.Tensor] | None = None
        # window layers' copy of that list in swa slots (pools with an swa slot space), valid with that list
        self._plain_swa: tuple[list, list[tuple[int, int, torch.Tensor, torch.Tensor]]] | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatchLike) -> None:
        seq_lens = forward_batch.seq_lens_cpu
        rows = forward_batch.req_to_token[forward_batch.req_pool_indices, :max(seq_lens)]  # [bs, max_len] int32
        bs = len(seq_lens)
        self._plain_reqs = None  # built on first use by a layer with a window, soft-cap or sinks
        if forward_batch.forward_mode.is_decode():
            self._extend_reqs = []
            self._groups = _build_groups(rows, list(range(bs)), [s - 1 for s in seq_lens], [1] * bs,
                                         list(range(bs)), whole_batch=True)
            return
        prefix_lens, extend_lens = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
        starts = _token_starts(extend_lens)
        # candidates for groups: one-token extends (decodes riding in a mixed batch, short jump-forwards)
        # and short extends after a cached prefix; fresh prompts and long extends run on their own
        cand = [i for i in range(bs) if extend_lens[i] == 1
                or (prefix_lens[i] > 0 and extend_lens[i] <= MAX_GROUPED_EXTEND)]
        self._groups = _build_groups(rows, cand, prefix_lens, extend_lens, starts, whole_batch=False)
        grouped = set()
        for g in self._groups:
            grouped.update(g.members)
        self._extend_reqs = []
        for i in range(bs):
            if i in grouped:
                continue
            prefix_len, extend_len = prefix_lens[i], extend_lens[i]
            total = prefix_len + extend_len
            if prefix_len == 0:  # a fresh prompt attends only to its own new k/v: plain causal, no gather
                self._extend_reqs.append((starts[i], extend_len, None, None))
                continue
            loc = rows[i, :total].to(torch.int64)
            mask = None
            if extend_len > 1:
                q_pos = torch.arange(prefix_len, total, device=rows.device)[:, None]
                mask = torch.arange(total, device=rows.device)[None, :] <= q_pos  # [extend_len, total] bool
            self._extend_reqs.append((starts[i], extend_len, loc, mask))

    def _init_plain(self, forward_batch: ForwardBatchLike) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        seq_lens = forward_batch.seq_lens_cpu
        rows = forward_batch.req_to_token[forward_batch.req_pool_indices, :max(seq_lens)]  # [bs, max_len] int32
        if forward_batch.forward_mode.is_decode():
            prefix_lens, extend_lens = [s - 1 for s in seq_lens], [1] * len(seq_lens)
        else:
            prefix_lens, extend_lens = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
        starts = _token_starts(extend_lens)
        return [(starts[i], extend_lens[i], rows[i, :seq_lens[i]].to(torch.int64),
                 torch.arange(prefix_lens[i], seq_lens[i], device=rows.device)) for i in range(len(seq_lens))]

    def forward_plain(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        """Attention with the layer's sliding window / soft-cap / sinks, one request at a time.

        q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim] -> q's shape.
        A key at position j is visible to the query at position i when j <= i and, with a window w,
        i - j < w (transformers' sliding-window mask)."""
        if self._plain_reqs is None:
            self._plain_reqs = self._init_plain(forward_batch)
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        reqs = self._plain_reqs
        if pool.full_to_swa is not None and pool.is_swa_layer(layer.layer_id):
            if self._plain_swa is None or self._plain_swa[0] is not reqs:  # built once a step
                self._plain_swa = (reqs, [(s, e, pool.full_to_swa[loc], p) for s, e, loc, p in reqs])
            reqs = self._plain_swa[1]
        window = getattr(layer, "sliding_window", None)
        cap = getattr(layer, "logit_softcap", None)
        sinks = getattr(layer, "sinks", None)  # [num_heads] logits, or None
        qf = q.to(k_buf.dtype)
        out = torch.empty_like(qf)
        rep = layer.num_heads // layer.num_kv_heads
        for start, extend_len, loc, q_pos in reqs:
            qi = qf[start:start + extend_len].transpose(0, 1)  # [num_heads, e, head_dim]
            ki = k_buf.index_select(0, loc).transpose(0, 1).repeat_interleave(rep, dim=0)  # [num_heads, total, d]
            vi = v_buf.index_select(0, loc).transpose(0, 1).repeat_interleave(rep, dim=0)
            scores = torch.matmul(qi, ki.transpose(-1, -2)) * layer.scaling  # [num_heads, e, total]
            if cap:
                scores = torch.tanh(scores / cap) * cap
            k_pos = torch.arange(loc.shape[0], device=loc.device)
            visible = k_pos[None, :] <= q_pos[:, None]  # [e, total]
            if window:
                visible &= q_pos[:, None] - k_pos[None, :] < window
            scores = scores.masked_fill(~visible, float("-inf"))
            if sinks is not None:
                sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, extend_len, 1)
                probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
            else:
                probs = scores.softmax(-1)
            out[start:start + extend_len] = torch.matmul(probs, vi).transpose(0, 1)
        return out.to(q.dtype)

    def forward_mla(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        """Multi-query attention over MLA's latent (``layer_features``: mla).

        q [num_tokens, num_heads, latent]; k [num_tokens, 1, latent]; v [num_tokens, 1, value_dim], k's
        leading features (the pool stores k alone) -> [num_tokens, num_heads, value_dim]."""
        if self._plain_reqs is None:
            self._plain_reqs = self._init_plain(forward_batch)
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf = pool.get_key_buffer(layer.layer_id)  # [slots, 1, latent]
        dv = v.shape[-1]
        qf = q.to(k_buf.dtype)
        reqs = self._plain_reqs
        if forward_batch.forward_mode.is_decode() and len(reqs) > 1:
            if self._mla_pad is None or self._mla_pad[0] is not reqs:
                lens = torch.tensor([loc.shape[0] for _, _, loc, _ in reqs], device=qf.device)
                slots = torch.nn.utils.rnn.pad_sequence([loc for _, _, loc, _ in reqs], batch_first=True)
                visible = torch.arange(slots.shape[1], device=qf.device)[None, :] < lens[:, None]
                self._mla_pad = (reqs, slots, visible[:, None, :])
            _, slots, visible = self._mla_pad
            bs, s = slots.shape
            kv = k_buf.index_select(0, slots.view(-1)).view(bs, s, -1)  # [bs, S, latent]
            scores = torch.bmm(qf, kv.transpose(1, 2)) * layer.scaling  # [bs, heads, S]
            probs = scores.masked_fill_(~visible, float("-inf")).softmax(-1)
            return torch.bmm(probs, kv[..., :dv]).to(q.dtype)  # [bs, heads, value_dim]
        out = qf.new_empty(qf.shape[0], qf.shape[1], dv)
        for start, extend_len, loc, q_pos in reqs:
            kv = k_buf.index_select(0, loc)[:, 0]  # [total, latent]
            scores = torch.matmul(qf[start:start + extend_len], kv.t()) * layer.scaling  # [e, heads, total]
            if extend_len > 1:
                visible = torch.arange(loc.shape[0], device=loc.device)[None, :] <= q_pos[:, None]  # [e, total]
                scores.masked_fill_(~visible[:, None, :], float("-inf"))
            out[start:start + extend_len] = torch.matmul(scores.softmax(-1), kv[:, :dv])
        return out.to(q.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        if getattr(layer, "mla", None) is not None:
            return self.forward_mla(q, k, v, layer, forward_batch)
        if layer_features(layer):
            return self.forward_plain(q, k, v, layer, forward_batch)
        return super().forward(q, k, v, layer, forward_batch)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        out_dtype = q.dtype  # attention runs in the pool's dtype (float32 on the CPU even for bf16 weights)
        q, k, v = q.to(k_buf.dtype), k.to(k_buf.dtype), v.to(k_buf.dtype)
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        gqa = layer.num_heads != layer.num_kv_heads
        for start, extend_len, loc, mask in self._extend_reqs:
            end = start + extend_len
            qi = q[start:end].transpose(0, 1)  # [num_heads, extend_len, head_dim]
            if loc is None:
                ki, vi = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            else:
                ki = k_buf.index_select(0, loc).transpose(0, 1)  # [num_kv_heads, total, head_dim]
                vi = v_buf.index_select(0, loc).transpose(0, 1)
            causal = mask is None and extend_len > 1
            if gqa and extend_len > 1:
                # torch's CPU flash kernel does not take enable_gqa (the math path it would fall back
                # to is much slower on long prompts, docs/cpu.md): give every query head its own copy
                # of the kv head
                rep = layer.num_heads // layer.num_kv_heads
                ki, vi = ki.repeat_interleave(rep, dim=0), vi.repeat_interleave(rep, dim=0)
            # 4-D inputs: torch's CPU flash kernel takes only [batch, heads, len, dim]; 3-D goes to the math path
            oi = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=mask, is_causal=causal,
                                                scale=layer.scaling, enable_gqa=gqa and extend_len == 1)
            out[start:end] = oi[0].transpose(0, 1)
        for g in self._groups:
            self._run_group(g, q, out, k_buf, v_buf, layer)
        return out.to(out_dtype)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerLike, forward_batch: ForwardBatchLike) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        qf = q.to(k_buf.dtype)
        if len(self._groups) == 1 and self._groups[0].q_rows is None:  # one group in batch order: no scatter
            out = _cascade(qf.unsqueeze(1), k_buf, v_buf, self._groups[0], layer).squeeze(1)
        else:
            out = torch.empty_like(qf)
            for g in self._groups:
                self._run_group(g, qf, out, k_buf, v_buf, layer)
        return out.to(q.dtype)

    @staticmethod
    def _run_group(g: _Group, q: torch.Tensor, out: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                   layer: AttentionLayerLike) -> None:
        n = g.own_loc.shape[0]
        qg = q if g.q_rows is None else q.index_select(0, g.q_rows)
        o = _cascade(qg.view(n, g.e_max, *q.shape[1:]), k_buf, v_buf, g, layer).reshape(-1, *q.shape[1:])
        if g.valid is not None:
            o = o[g.valid]
        if g.out_rows is None:
            out.copy_(o)
        else:
            out.index_copy_(0, g.out_rows, o)


def _cascade(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, g: _Group,
             layer: AttentionLayerLike) -> torch.Tensor:
    """q [n, e, num_heads, d] -> attention output of the same shape over the shared run + each own tail."""
    n, e, hq, d = q.shape
    hkv = layer.num_kv_heads
    s = g.own_loc.shape[1]
    # index_select on the flat slots gathers faster on the CPU than advanced indexing with a 2-D index
    # (docs/cpu.md)
    kx = k_buf.index_select(0, g.own_loc.view(-1)).view(n, s, hkv, d).transpose(1, 2)  # [n, hkv, S, d]
    vx = v_buf.index_select(0, g.own_loc.view(-1)).view(n, s, hkv, d).transpose(1, 2)
    if g.shared_loc is None:  # nothing shared: one SDPA (faster than the matmuls below on small shapes)
        mask = None if g.own_mask is None else g.own_mask[:, None]  # [n, 1, e, S]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), kx, vx, attn_mask=mask, scale=layer.scaling,
                                           enable_gqa=hq != hkv)  # [n, hq, e, d]
        return o.transpose(1, 2)
    rep = hq // hkv
    if e > 1 and _FLASH_LSE is not None and q.device.type == "cpu":
        return _cascade_flash(q, kx, vx, k_buf, v_buf, g, layer)
    # [n, hkv, e*rep, d]: a kv head's query heads and the request's queries side by side
    qs = (q * layer.scaling).view(n, e, hkv, rep, d).permute(0, 2, 1, 3, 4).reshape(n, hkv, e * rep, d)
    scores = torch.matmul(qs, kx.transpose(-1, -2))  # [n, hkv, e*rep, S]
    if g.own_mask is not None:
        scores.view(n, hkv, e, rep, s).masked_fill_(~g.own_mask[:, None, :, None, :], float("-inf"))
    length = g.shared_loc.shape[0]
    ks = k_buf.index_select(0, g.shared_loc).permute(1, 2, 0)  # [hkv, d, L]
    vs = v_buf.index_select(0, g.shared_loc).transpose(0, 1)  # [hkv, L, d]
    shared = torch.matmul(qs.transpose(0, 1).reshape(hkv, n * e * rep, d), ks)  # [hkv, n*e*rep, L]
    p = torch.cat([shared.view(hkv, n, e * rep, length).transpose(0, 1), scores], dim=-1).softmax(-1)
    p_shared = p[..., :length].transpose(0, 1).reshape(hkv, n * e * rep, length)
    o = torch.matmul(p_shared, vs).view(hkv, n, e * rep, d).transpose(0, 1) + torch.matmul(p[..., length:], vx)
    return o.view(n, hkv, e, rep, d).permute(0, 2, 1, 3, 4).reshape(n, e, hq, d)


def _cascade_flash(q: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                   g: _Group, layer: AttentionLayerLike) -> torch.Tensor:
    """Multi-token queries: two flash attentions (shared run, own tails) merged by their log-sum-exps.

    The single-softmax form above materializes [queries, L + S] scores several times over; for a
    batch of few-shot questions this is faster (docs/cpu.md)."""
    n, e, hq, d = q.shape
    rep = hq // layer.num_kv_heads
    if g.shared_loc is None:
        raise RuntimeError("_cascade_flash needs a group with a shared run")
    bias = g.own_bias if g.own_bias is None or g.own_bias.dtype == q.dtype else g.own_bias.to(q.dtype)
    # the kernel takes no grouped heads: each query head gets its kv head's copy
    kx, vx = kx.repeat_interleave(rep, dim=1), vx.repeat_interleave(rep, dim=1)  # [n, hq, S, d]
    o_own, lse_own = _FLASH_LSE(q.transpose(1, 2), kx, vx, 0.0, False, attn_mask=bias, scale=layer.scaling)
    ks = k_buf.index_select(0, g.shared_loc).repeat_interleave(rep, dim=1).transpose(0, 1)[None]  # [1, hq, L, d]
    vs = v_buf.index_select(0, g.shared_loc).repeat_interleave(rep, dim=1).transpose(0, 1)[None]
    o_sh, lse_sh = _FLASH_LSE(q.reshape(1, n * e, hq, d).transpose(1, 2), ks, vs, 0.0, False, scale=layer.scaling)
    o_sh = o_sh[0].view(hq, n, e, d).transpose(0, 1)  # [n, hq, e, d]
    lse_sh = lse_sh[0].view(hq, n, e).transpose(0, 1)  # [n, hq, e]
    lse = torch.logaddexp(lse_sh, lse_own)
    o = o_sh * (lse_sh - lse).exp_().unsqueeze(-1) + o_own * (lse_own - lse).exp_().unsqueeze(-1)
    return o.transpose(1, 2)  # [n, e, hq, d]


def _build_groups(rows: torch.Tensor, cand: list[int], prefix_lens: list[int], extend_lens: list[int],
                  starts: list[int], *, whole_batch: bool) -> list[_Group]:
    """Group the candidate requests by the KV slots they start with.

    Requests whose first slot is the same share a run of slots (the radix cache hands them the same
    prefix); the run's length is where their rows first differ, at most the shortest cached prefix.
    Requests left over form one group without a shared run when they are all one-token queries
    (a decode batch); left-over multi-token extends are not grouped (the caller runs them one by one).
    """
    if not cand:
        return []
    buckets: dict[int, list[int]] = defaultdict(list)
    for i, first in zip(cand, rows[cand, 0].tolist()):
        buckets[first].append(i)
    groups, loners = [], []
    for members in buckets.values():
        length = _shared_run(rows, members, min(prefix_lens[i] for i in members)) if len(members) > 1 else 0
        if length >= MIN_SHARED:
            groups.append(_make_group(rows, members, length, prefix_lens, extend_lens, starts))
        else:
            loners += members
    singles = sorted(i for i in loners if extend_lens[i] == 1)
    if singles and (whole_batch or len(singles) > 1):
        groups.append(_make_group(rows, singles, 0, prefix_lens, extend_lens, starts))
    if whole_batch and len(groups) == 1 and groups[0].members == cand:
        groups[0].q_rows = groups[0].out_rows = None  # batch order already: no gather, no scatter
    return groups


def _shared_run(rows: torch.Tensor, members: list[int], cap: int) -> int:
    """How many leading KV slots all members' rows have in common, at most cap."""
    if cap <= 0:
        return 0
    sub = rows[members, :cap]
    same = (sub == sub[0]).all(0)
    return cap if bool(same.all()) else int(same.to(torch.int8).argmin())


def _make_group(rows: torch.Tensor, members: list[int], shared: int, prefix_lens: list[int],
                extend_lens: list[int], starts: list[int]) -> _Group:
    device = rows.device
    e_max = max(extend_lens[i] for i in members)
    own_lens = [prefix_lens[i] + extend_lens[i] - shared for i in members]
    s = max(own_lens)
    own = rows[members, shared:shared + s].to(torch.int64)
    own_len_t = torch.tensor(own_lens, device=device)
    key = torch.arange(s, device=device)
    key_ok = key[None, :] < own_len_t[:, None]  # [n, S]
    own = torch.where(key_ok, own, torch.zeros_like(own))
    if e_max == 1:
        own_mask = None if min(own_lens) == s else key_ok[:, None, :]
        q_idx = [starts[i] for i in members]
        valid = None
    else:
        # query j of member m sits at position prefix + j (padded queries repeat the last real one)
        ext = torch.tensor([extend_lens[i] for i in members], device=device)
        qj = torch.minimum(torch.arange(e_max, device=device)[None, :], ext[:, None] - 1)  # [n, e_max]
        q_pos = torch.tensor([prefix_lens[i] for i in members], device=device)[:, None] + qj
        own_mask = key_ok[:, None, :] & (shared + key[None, None, :] <= q_pos[:, :, None])  # [n, e_max, S]
        q_idx = [starts[i] + min(j, extend_lens[i] - 1) for i in members for j in range(e_max)]
        valid_list = [j < extend_lens[i] for i in members for j in range(e_max)]
        valid = None if all(valid_list) else torch.tensor(valid_list, device=device)
    q_rows = torch.tensor(q_idx, device=device)
    out_rows = q_rows if valid is None else q_rows[valid]
    own_bias = None
    if e_max > 1 and own_mask is not None:
        own_bias = torch.zeros(own_mask.shape, device=device).masked_fill_(~own_mask, float("-inf"))[:, None]
    return _Group(members=members, q_rows=q_rows, out_rows=out_rows, valid=valid, e_max=e_max,
                  shared_loc=rows[members[0], :shared].to(torch.int64) if shared else None,
                  own_loc=own, own_mask=own_mask, own_bias=own_bias)


def _token_starts(extend_lens: list[int]) -> list[int]:
    starts, acc = [], 0
    for e in extend_lens:
        starts.append(acc)
        acc += e
    return starts

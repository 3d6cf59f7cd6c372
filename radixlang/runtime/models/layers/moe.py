"""A fused mixture-of-experts MLP: every expert's gate/up and down weights in two stacked tensors, the
routing rule of the model (softmax then top-k, with or without renormalising the top-k; DeepSeek's
grouped routing, V2 over softmax scores, V3 over sigmoid scores with a selection bias), an optional
shared expert, and a dispatch that sorts the (token, expert) pairs by expert so each expert runs one
matmul over all its tokens: the Python loop is over experts (at most ``num_experts`` steps), never
over tokens. On the CPU in float32 with SwiGLU experts, the compiled kernels replace all of that: the
experts' weights are repacked once into the panels kernels/cpu/csrc/moe.c reads, and every step (decode
or prefill) runs the routed experts in one call that reads each expert's weights once for all its tokens.
A shared expert (Qwen2-MoE, DeepSeek) is folded into that call as extra experts of the routed width,
which every token picks, weighted by its gate (Qwen2-MoE) or by 1 (DeepSeek).

On CUDA the per-expert loop cannot run inside a captured decode graph (its extent is read from the
device, and a replay would keep the captured routing): the experts run as two grouped GEMMs over the
expert-sorted, block-padded pairs (kernels/fused_moe.py, the Triton kernel of kernels/triton_ops/
fused_moe.py), whose shapes follow from the batch size alone. Without triton, and for experts that kernel
does not run, ``dispatch`` switches to a static every-expert form while a graph is being captured.

Under tensor parallelism every rank holds every expert, each over its slice of the intermediate
features (gate/up rows, down columns, as a dense MLP is split); the router is replicated, so every rank
routes a token to the same experts, and the ranks' partial sums are all-reduced once per layer.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from radixlang.kernels import cpu as cpu_ops
from radixlang.kernels import fused_moe
from radixlang.runtime.models.layers.linear import Linear, set_weight_loader
from radixlang.runtime.models.layers.weight_methods import PLAIN, WeightMethods
from radixlang.runtime.models.parallel import TPComm, shard_tensor, split_evenly

# checkpoint names of one expert's tensors: Qwen's gate/up/down_proj, Mixtral's w1 (gate) / w3 (up) / w2 (down)
_EXPERT = re.compile(r"^(?P<owner>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj|w1|w2|w3)"
                     r"\.weight$")
_PART = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
         "down_proj": ("w2", None), "w2": ("w2", None)}


def route_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k logits, then a softmax over those k (GPT-OSS). logits [n, E] -> (weights [n, k], ids [n, k])."""
    top, ids = logits.topk(top_k, dim=-1)
    return top.softmax(-1), ids


def route_softmax_topk(logits: torch.Tensor, top_k: int, *, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (in float32), then the top k; ``renormalize``: the k weights sum to 1
    (Mixtral always, Qwen when ``norm_topk_prob``). logits [n, E] -> (weights [n, k] f32, ids [n, k] i64)."""
    weights, ids = logits.float().softmax(-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def _group_mask(choice: torch.Tensor, group_scores: torch.Tensor, topk_group: int) -> torch.Tensor:
    """[n, E] bool: the experts of each token's ``topk_group`` best groups (group_scores [n, groups])."""
    n, groups = group_scores.shape
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
    return keep[:, :, None].expand(n, groups, choice.shape[1] // groups).reshape(n, -1)


def route_softmax_grouped(logits: torch.Tensor, top_k: int, *, n_group: int | None = None,
                          topk_group: int | None = None,
                          scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: softmax over all experts (float32), the top k, times ``scale`` (routed_scaling_factor),
    not renormalised. With ``n_group`` (topk_method "group_limited_greedy") the experts are split into
    n_group equal groups, a group scores its best expert, and only the ``topk_group`` best groups' experts
    can be picked. logits [n, E] -> (weights [n, k] f32, ids [n, k] i64)."""
    scores = logits.float().softmax(-1)
    choice = scores
    if n_group and n_group > 1:
        group_best = scores.view(scores.shape[0], n_group, -1).amax(-1)  # [n, groups]
        choice = scores.masked_fill(~_group_mask(scores, group_best, int(topk_group or n_group)), 0.0)
    weights, ids = choice.topk(top_k, dim=-1)
    return weights * scale, ids


def route_sigmoid_grouped(logits: torch.Tensor, top_k: int, *, bias: torch.Tensor, n_group: int | None,
                          topk_group: int | None, renormalize: bool,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: sigmoid scores (float32); the experts are picked by score + ``bias``
    (e_score_correction_bias) among the ``topk_group`` best of ``n_group`` groups (a group scores the sum of
    its two best biased scores); their weights are the unbiased scores, renormalised to sum to 1 when
    ``renormalize`` (norm_topk_prob), times ``scale`` (routed_scaling_factor).
    logits [n, E] -> (weights [n, k] f32, ids [n, k] i64)."""
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    if n_group and n_group > 1:
        per_group = choice.view(choice.shape[0], n_group, -1)
        group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)  # [n, groups]
        choice = choice.masked_fill(~_group_mask(choice, group_scores, int(topk_group or n_group)), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, ids


class DenseSwiGLU(Protocol):
    """A shared expert as llama.MLP holds it: gate_up_proj (gate rows, then up rows), down_proj, this rank's
    intermediate width, the activation's name, and this rank's term of its output."""

    @property
    def gate_up_proj(self) -> Linear: ...

    @property
    def down_proj(self) -> Linear: ...

    @property
    def inter(self) -> int: ...

    @property
    def act_name(self) -> str: ...

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor: ...


class ExpertsMethod:
    """How an ``Experts`` layer holds and runs its experts' weights, as a ``LinearMethod`` does for a linear
    (layers/linear.py); this base is the float one: the stacked w13 / w2 parameters the checkpoint loads
    into, run by ``Experts.float_forward``. A subclass (a GGUF file's expert blocks: models/gguf_experts.py)
    creates its own storage instead and is bound before any tensor is read (``Experts.rebind``)."""

    name = "float"

    def create_weights(self, experts: Experts) -> None:
        e, inter, hidden = experts.num_experts, experts.inter, experts.hidden
        experts.register_parameter("w13", nn.Parameter(torch.empty(e, 2 * inter, hidden), requires_grad=False))
        experts.register_parameter("w2", nn.Parameter(torch.empty(e, hidden, inter), requires_grad=False))
        set_weight_loader(experts.w13, ExpertLoader(experts.tp, gate_up=True))
        set_weight_loader(experts.w2, ExpertLoader(experts.tp, gate_up=False))

    def apply(self, experts: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [n, hidden]; weights, ids [n, k] -> this rank's term of the experts' weighted sum, [n, hidden]."""
        return experts.float_forward(x, weights, ids)


class Experts(nn.Module):
    """``num_experts`` gated MLPs held by ``method`` (the float one: w13 [E, 2 * inter, hidden], gate rows
    then up rows, w2 [E, hidden, inter]); after ``pack_`` both are None and ``packed`` holds them (with a
    folded shared expert's parts)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, act: Callable[[torch.Tensor], torch.Tensor],
                 *, act_is_silu: bool, tp: TPComm | None = None) -> None:
        """``inter``: the checkpoint's intermediate size; a rank of ``tp`` holds inter / tp.size of it."""
        super().__init__()
        if tp is not None:
            inter = split_evenly(inter, tp.size, "expert intermediate features")
        self.num_experts, self.hidden, self.inter, self.tp = num_experts, hidden, inter, tp
        self.w13: nn.Parameter | None
        self.w2: nn.Parameter | None
        self.method = ExpertsMethod()
        self.method.create_weights(self)
        self.act, self.act_is_silu = act, act_is_silu
        self.packed: cpu_ops.PackedExperts | None = None  # pack_: the compiled kernel runs every expert
        self.num_shared = 0  # experts past num_experts in ``packed``: a shared expert folded in (pack_)

    def rebind(self, method: ExpertsMethod) -> None:
        """Before any tensor is read: hold and run the experts with ``method`` (its storage replaces the
        float w13 / w2, dropped unwritten)."""
        self.method = method
        method.create_weights(self)

    def extra_repr(self) -> str:
        return f"{self.num_experts} experts, {self.hidden} -> {self.inter}, method={self.method.name}"

    def packable(self) -> bool:
        """Whether ``pack_`` applies: float32 SwiGLU experts on the CPU, not packed yet."""
        return (self.act_is_silu and self.w13 is not None and self.w13.dtype == torch.float32
                and self.w13.device.type == "cpu")

    def pack_(self, shared: DenseSwiGLU | None = None) -> bool:
        """Repack the experts into csrc/moe.c's panels and drop the plain w13 / w2 (no second copy of the
        experts is kept). ``shared``: a dense SwiGLU MLP (this rank's slice under tp) with plain float32
        weights: its gate/up rows and down columns are cut into ``num_shared`` extra experts of this width
        (the last zero-padded), which sum to it (SwiGLU is a sum over its intermediate features). Returns
        whether ``shared`` was folded in (the caller may then drop it)."""
        if not self.packable():
            raise ValueError(f"the compiled MoE kernel runs float32 SwiGLU experts on the CPU, not these "
                             f"({'SwiGLU' if self.act_is_silu else 'another activation'}, "
                             f"{'already packed' if self.w13 is None else f'{self.w13.dtype} on {self.w13.device}'})")
        parts = _shared_parts(shared, self.inter, self.hidden) if shared is not None else None
        w13, w2 = list(self.w13.detach()), list(self.w2.detach())  # views, one per expert
        if parts is not None:
            w13, w2 = w13 + list(parts[0]), w2 + list(parts[1])
            self.num_shared = parts[0].shape[0]
        self.packed = cpu_ops.moe_pack(w13, w2)
        self.w13 = self.w2 = None  # type: ignore[assignment]  # registered None: gone from the state dict
        return parts is not None

    def with_shared(self, weights: torch.Tensor, ids: torch.Tensor,
                    scale: torch.Tensor | float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing plus the folded shared expert's parts (see pack_), each token's pick with ``scale``
        ([n, 1] or a number) as its weight."""
        n = ids.shape[0]
        extra = torch.arange(self.num_experts, self.num_experts + self.num_shared, dtype=ids.dtype).expand(n, -1)
        scale = scale.float().expand(n, self.num_shared) if isinstance(scale, torch.Tensor) else \
            torch.full((n, self.num_shared), float(scale))
        return torch.cat([weights.float(), scale], 1), torch.cat([ids, extra], 1)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *,
                reduce: bool = True) -> torch.Tensor:
        """x [n, hidden]; weights, ids [n, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x), [n, hidden]
        (summed over the tensor-parallel ranks; ``reduce=False``: this rank's term, the caller sums)."""
        out = self.method.apply(self, x, weights, ids)
        return out if self.tp is None or not reduce else self.tp.all_reduce(out)

    def float_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The float method's term: the compiled kernel once packed, the grouped GEMMs on CUDA, else
        ``dispatch``."""
        if self.packed is not None:
            out = cpu_ops.moe_experts(x.contiguous(), weights.float().contiguous(), ids.contiguous(), self.packed,
                                      check=False)
        elif x.is_cuda:
            out = self._forward_device(x, weights, ids)
        else:
            out = dispatch(x, weights, ids, self.num_experts, self._expert)
        return out

    def _forward_device(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The CUDA path: the Triton fused-MoE grouped GEMM (graph-safe: no host reads, shapes fixed by the
        batch size); without triton, ``dispatch`` (static while a CUDA graph is captured)."""
        gemm = fused_moe.device_grouped_gemm()
        if gemm is None:
            return dispatch(x, weights, ids, self.num_experts, self._expert)
        return fused_moe.fused_experts(x, self.w13, self.w2, weights, ids, act_and_mul=self._act_and_mul,
                                       gemm=gemm)

    def _act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.inter, dim=-1)  # [rows, inter] each
        return self.act(gate) * up

    def _expert(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        return F.linear(self._act_and_mul(F.linear(xs, self.w13[e])), self.w2[e])


def dispatch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
             expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Sort the (token, expert) pairs by expert, run ``expert(e, its tokens' rows)`` once per expert with
    tokens, and sum the outputs back per token weighted by the routing weights (in choice order).

    x [n, hidden]; weights [n, k] float; ids [n, k] int64 -> [n, hidden] in x's dtype.

    The loop's extent is read from the device (the experts' token counts), which a CUDA graph capture
    forbids and a replay would freeze: while a CUDA stream is capturing, ``dispatch_static`` runs instead."""
    if x.is_cuda and capturing_cuda_graph():
        return dispatch_static(x, weights, ids, num_experts, expert)
    n, k = ids.shape
    flat = ids.reshape(-1)  # [n * k]: pair p is token p // k
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // k
    xs = x.index_select(0, tokens)  # [n * k, hidden], grouped by expert
    out = torch.empty_like(xs)
    start = 0
    for e, count in enumerate(counts):
        if count:
            out[start:start + count] = expert(e, xs[start:start + count])
            start += count
    # back to (token, choice) order, then a weighted sum over each token's k choices: index_add_ into the
    # tokens took ~0.5 ms a call at one token in the engine (11 us alone), this takes a few us
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return (unsorted.view(n, k, x.shape[1]) * weights.to(out.dtype)[..., None]).sum(1)


def capturing_cuda_graph() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def dispatch_static(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                    expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``dispatch`` with shapes fixed by x alone, for a CUDA graph: every expert runs over every token and
    its output is weighted by the token's routing weight for it (0 where not picked). No host reads and
    nothing routing-dependent in the shapes, at num_experts / k times dispatch's compute: the fallback of
    the CUDA path without triton, and of experts the fused kernel does not run (biased, clamped ones).

    x [n, hidden]; weights [n, k] float; ids [n, k] int64 -> [n, hidden] in x's dtype."""
    dense = torch.zeros((ids.shape[0], num_experts), dtype=torch.float32, device=x.device)
    dense.scatter_add_(1, ids.long(), weights.float())  # [n, E] each token's weight per expert
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        out += dense[:, e:e + 1] * expert(e, x).float()
    return out.to(x.dtype)


class MoEBlock(nn.Module):
    """A MoE layer's feed-forward block whose float experts the compiled kernel can run (llama.use_cpu_kernels
    calls ``pack_experts_`` where ``experts.packable()``)."""
    experts: Experts

    def pack_experts_(self) -> None:
        raise NotImplementedError


class SparseMoE(MoEBlock):
    """Router (``gate``, [E, hidden]) + experts + optional shared expert (Qwen2-MoE: a dense MLP scaled
    by sigmoid(shared_expert_gate(x)))."""

    def __init__(self, config: Any, *, num_experts: int, top_k: int, inter: int, renormalize: bool,
                 act: Callable[[torch.Tensor], torch.Tensor], act_is_silu: bool,
                 shared_expert: DenseSwiGLU | None = None, tp: TPComm | None = None,
                 methods: WeightMethods = PLAIN) -> None:
        """``shared_expert`` is built for the same ``tp`` (a dense MLP that sums over the ranks itself)."""
        super().__init__()
        hidden = config.hidden_size
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Linear(hidden, num_experts, method=methods.linear(hidden))  # replicated: every rank routes alike
        self.experts = Experts(num_experts, hidden, inter, act, act_is_silu=act_is_silu, tp=tp)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (Linear(hidden, 1, method=methods.linear(hidden)) if shared_expert is not None
                                   else None)
        self.tp = tp
        self.fused = False  # the decoder layer's sliced path is for dense MLPs (see llama.DecoderLayer)
        self.shared_folded = False  # pack_experts_: the shared expert runs inside the experts' kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden]. Under tensor parallelism the experts' and the shared expert's
        terms (its per-token gate scales each rank's term alike) are summed in one all-reduce."""
        weights, ids = route_softmax_topk(self.gate(x), self.top_k, renormalize=self.renormalize)
        if self.shared_folded and self.shared_expert_gate is not None:  # in the experts' kernel (Experts.pack_)
            return self.experts(x, *self.experts.with_shared(weights, ids, torch.sigmoid(self.shared_expert_gate(x))))
        if self.shared_expert is None or self.shared_expert_gate is None:
            return self.experts(x, weights, ids)
        out = self.experts(x, weights, ids, reduce=False)
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial_sum(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def pack_experts_(self) -> None:
        """Run the experts, and the shared expert where it folds in, on the compiled kernel (Experts.pack_)."""
        if self.experts.pack_(self.shared_expert):
            self.shared_expert, self.shared_folded = None, True


def _plain_weight(linear: Linear) -> torch.Tensor | None:
    """A bias-free linear's float32 row-major weight (a packed linear's kept plain copy), else None."""
    kept = linear.float32_weight()
    return kept[0] if kept is not None and kept[1] is None else None


def _shared_parts(mlp: DenseSwiGLU, inter: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A dense SwiGLU MLP (gate_up_proj: gate rows then up rows; down_proj) as S experts of ``inter``
    features, the last padded with zero features (silu(0) * 0 adds nothing): (w13 [S, 2 * inter, hidden],
    w2 [S, hidden, inter]); None when its weights are not plain float32 ones."""
    gate_up, down, width = _plain_weight(mlp.gate_up_proj), _plain_weight(mlp.down_proj), mlp.inter
    if (gate_up is None or down is None or mlp.act_name != "silu"
            or gate_up.shape != (2 * width, hidden) or down.shape != (hidden, width)):
        return None
    parts = -(-width // inter)
    pad = parts * inter - width
    gate, up = (F.pad(half, (0, 0, 0, pad)).view(parts, inter, hidden) for half in gate_up.split(width))
    return torch.cat([gate, up], 1), F.pad(down, (0, pad)).view(hidden, parts, inter).transpose(0, 1)


def expert_checkpoint_param(name: str) -> tuple[str, int] | None:
    """The stacked parameter an expert's checkpoint tensor loads into and its piece there (ExpertLoader):
    ``layers.0.mlp.experts.3.up_proj.weight`` -> (``layers.0.mlp.experts.w13``, 7); None for any other name."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    target, half = _PART[m["part"]]
    e = int(m["expert"])
    return f"{m['owner']}.{target}", e if half is None else 2 * e + half


class ExpertLoader:
    """The ``weight_loader`` of a float expert stack (layers/linear.py's WeightLoader): w13 [E, 2 * inter,
    hidden] takes piece 2e (expert e's gate) and 2e + 1 (its up), each this rank's rows under tp; w2
    [E, hidden, inter] takes piece e (expert e's down), this rank's columns."""

    def __init__(self, tp: TPComm | None, *, gate_up: bool) -> None:
        self.tp, self.gate_up = tp, gate_up

    def __call__(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
        if shard is None:
            raise ValueError(f"an expert stack {tuple(param.shape)} takes one expert's tensor at a time, "
                             f"given no expert")
        if self.tp is not None:
            tensor = shard_tensor(tensor, self.tp.rank, self.tp.size, dim=0 if self.gate_up else 1)
        e, half = divmod(shard, 2) if self.gate_up else (shard, 0)
        if e >= param.shape[0]:
            raise ValueError(f"a checkpoint tensor of expert {e}: the model has {param.shape[0]} experts")
        rows = param.shape[1] // 2 if self.gate_up else param.shape[1]
        param.data[e, half * rows:(half + 1) * rows].copy_(tensor)


def expert_checkpoint_tensors(name: str, t: torch.Tensor, parts: tuple[str, str, str]):
    """The checkpoint pieces of a stacked expert tensor ``name`` (…experts.w13 / …experts.w2) as
    (checkpoint name, tensor) pairs; ``parts`` names gate, up and down (("gate_proj", "up_proj", "down_proj"))."""
    owner, _, leaf = name.rpartition(".")
    for e in range(t.shape[0]):
        if leaf == "w13":
            gate, up = t[e].split(t.shape[1] // 2)
            yield f"{owner}.{e}.{parts[0]}.weight", gate
            yield f"{owner}.{e}.{parts[1]}.weight", up
        else:
            yield f"{owner}.{e}.{parts[2]}.weight", t[e]

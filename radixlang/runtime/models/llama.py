"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM) whose attention runs through the AttentionBackend.

The options these families differ by are read from the config: q/k/v bias (``attention_bias``, always
on for Qwen2), a per-head RMSNorm of q and k before the rotation (Qwen3, ``qk_norm``), a sliding window
on the layers ``layer_types`` marks ``sliding_attention`` (or on every layer when a config sets
``sliding_window`` without ``layer_types``, as Mistral's does). The family files subclass this one.

q/k/v and gate/up are fused into one matmul each: on a CPU at batch 1 the
number of ops per layer matters as much as their size. With a tensor-parallel
group (``tp``), each rank holds its heads and its slice of the MLP and vocabulary
(models/parallel.py), and each parameter's ``weight_loader`` takes the rank's slice of its checkpoint
tensors; without one the layers are whole. Every projection is a ``Linear`` built with the weight method
``methods`` gives it (layers/linear.py, layers/weight_methods.py), chosen before loading.
"""
from __future__ import annotations

from typing import Any, ClassVar, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from radixlang.kernels import cpu as cpu_ops
from radixlang.runtime.models import packed
from radixlang.runtime.models.layers.attention_config import layer_sliding_window
from radixlang.runtime.models.layers.linear import Linear, Piece, set_weight_loader, weight_loader_of
from radixlang.runtime.models.layers.moe import Experts, MoEBlock, expert_checkpoint_param
from radixlang.runtime.models.layers.norm import RMSNorm
from radixlang.runtime.models.layers.weight_methods import PLAIN, WeightMethods
from radixlang.runtime.models.layers.rotary import (Rotary, apply_rope, partial_rotary_factor,
                                                    length_rows, rope_context_length, rope_switch_point,
                                                    rope_tables)
from radixlang.runtime.models.parallel import (ParallelLMHead, RowParallelLinear, TPComm, VocabParallelEmbedding,
                                               column_linear, kv_heads_per_rank, split_evenly)


def check_tensor_parallel(config: Any, tp_size: int) -> None:
    """A ValueError when the model's heads or MLP do not split over ``tp_size`` ranks (before any rank starts)."""
    heads = config.num_attention_heads
    kv_heads_per_rank(heads, getattr(config, "num_key_value_heads", None) or heads, tp_size)
    split_evenly(config.intermediate_size, tp_size, "intermediate (MLP) features")
    if getattr(config, "moe_intermediate_size", None):  # each expert is split like a dense MLP
        split_evenly(config.moe_intermediate_size, tp_size, "expert intermediate features")


def row_linear(in_features: int, out_features: int, tp: TPComm | None, methods: WeightMethods, *,
               bias: bool = False) -> Linear:
    """An output projection: whole without tensor parallelism, else row-parallel over the ranks."""
    if tp is None:
        return Linear(in_features, out_features, bias=bias, method=methods.linear(in_features))
    return RowParallelLinear(in_features, out_features, tp=tp, bias=bias,
                             method=methods.row_parallel(in_features // tp.size))


_apply_rope = apply_rope  # the name tests/kernels compare the compiled kernel with


class Attention(nn.Module):
    qk_norm = False  # Qwen3, Gemma3: RMSNorm over each head of q and of k before the rotation

    def __init__(self, config: Any, layer_id: int, tp: TPComm | None = None, methods: WeightMethods = PLAIN) -> None:
        super().__init__()
        self.layer_id = layer_id
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        # the heads this rank holds
        self.num_heads, self.num_kv_heads = ((total_heads, total_kv_heads) if tp is None
                                             else kv_heads_per_rank(total_heads, total_kv_heads, tp.size))
        # Gemma scales scores by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5
        self.scaling = float(getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Qwen2 (qkv_bias in Qwen2-MoE's config) biases q/k/v only; attention_bias also biases o_proj
        o_bias = bool(getattr(config, "attention_bias", False))
        bias = o_bias or config.model_type == "qwen2" or bool(getattr(config, "qkv_bias", False))
        # this rank's q heads and kv heads of the full q/k/v tensors, side by side (models/parallel.py)
        qkv_parts = [("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)]
        self.qkv_proj = column_linear(config.hidden_size, qkv_parts, tp, methods.linear(config.hidden_size),
                                      bias=bias, num_kv_heads=total_kv_heads)
        self.o_proj = row_linear(total_heads * self.head_dim, config.hidden_size, tp, methods, bias=o_bias)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # read by the attention backend (kernels/attention/base.py: layer_features)
        self.sliding_window = layer_sliding_window(config, layer_id)
        self.logit_softcap: float | None = getattr(config, "attn_logit_softcapping", None) or None
        self.sinks: torch.Tensor | None = None

    def attend(self, x: torch.Tensor, rope: Rotary, forward_batch: Any) -> torch.Tensor:
        """Everything but the output projection: x [num_tokens, hidden] -> [num_tokens, heads * head_dim]."""
        qkv = self.qkv_proj(x).contiguous()  # [n, q_size + 2 * kv_size]; the view below needs packed rows
        n, qk_size = x.shape[0], self.q_size + self.kv_size
        # q and k rotated in one go: at batch 1 on a CPU every op counts
        qk = qkv[:, :qk_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # in place: qk is a view of qkv, which v is read from below
            qk[:, :self.num_heads] = self.q_norm(qk[:, :self.num_heads])
            qk[:, self.num_heads:] = self.k_norm(qk[:, self.num_heads:])
        if rope.cos is None:  # the compiled CPU kernel rotates them in place inside qkv
            cpu_ops.rope_(qk, rope.positions, rope.cos_cache, rope.sin_cache, check=False)
        elif rope.cos.shape[-1] == self.head_dim:
            qk = apply_rope(qk, rope.cos, rope.sin)
        else:  # partial rotary: only the first rotary_dim features of each head turn
            r = rope.cos.shape[-1]
            qk = torch.cat([apply_rope(qk[..., :r], rope.cos, rope.sin), qk[..., r:]], dim=-1)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].view(n, self.num_kv_heads, self.head_dim)
        out = forward_batch.attn_backend.forward(q, k, v, self, forward_batch)  # [n, heads, head_dim]
        return out.reshape(n, self.q_size)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh, "gelu_tanh": _gelu_tanh}


class MLP(nn.Module):
    def __init__(self, config: Any, tp: TPComm | None = None, *, intermediate_size: int | None = None,
                 methods: WeightMethods = PLAIN) -> None:
        super().__init__()
        full = intermediate_size or config.intermediate_size
        self.inter = full if tp is None else split_evenly(full, tp.size, "intermediate (MLP) features")
        self.gate_up_proj = column_linear(config.hidden_size, [("gate", self.inter), ("up", self.inter)], tp,
                                          methods.linear(config.hidden_size))
        self.down_proj = row_linear(full, config.hidden_size, tp, methods)
        # under tensor parallelism down_proj is row-parallel (whatever its weight method: float, or a GGUF's
        # blocks) and gives this rank's term of its sum
        self.row_parallel = tp is not None
        self.fused = False  # the compiled CPU kernel for silu(gate) * up
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"MLP activation {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
        self.act_name = act
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._hidden(x))

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the output, not yet summed over the tensor-parallel ranks (a MoE layer sums
        it with its experts' in one all-reduce); without tensor parallelism, the output."""
        down = self.down_proj
        return down.partial_sum(self._hidden(x)) if self.row_parallel else down(self._hidden(x))

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, [n, inter]: the compiled kernel's SiLU when fused."""
        if self.fused:
            return cpu_ops.silu_mul(self.gate_up_proj(x).contiguous(), check=False)
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.act(gate) * up


class DecoderLayer(nn.Module):
    attention_cls: type[Attention] = Attention
    # the hook of the fused CPU decode step (model_executor/decode_stack.py), which runs this class's forward
    # in C: a subclass changing what a layer computes (its forward, attention or MLP) must not inherit the
    # claim, so a subclass keeps it only by declaring it again (Qwen3's q/k norms are within the step)
    fused_decode: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.fused_decode = bool(cls.__dict__.get("fused_decode", False))

    def __init__(self, config: Any, layer_id: int, tp: TPComm | None = None, methods: WeightMethods = PLAIN) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_id, tp, methods)
        self.mlp = self.make_mlp(config, layer_id, tp, methods)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.row_slices = tp is None  # see forward (tensor parallel would all-reduce once per slice)

    def make_mlp(self, config: Any, layer_id: int, tp: TPComm | None, methods: WeightMethods) -> nn.Module:
        """The layer's feed-forward block (the MoE families return their sparse block)."""
        return MLP(config, tp, methods=methods)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rotary,
                forward_batch: Any, keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream rides beside the layer's output: x is the previous sublayer's output (the
        embeddings when residual is None), residual the sum before it. Returns (mlp output, residual),
        of the ``keep_rows`` rows only when given: past attention, no other row is computed."""
        x, residual = self.input_layernorm.add_norm(x, residual)
        x = self.self_attn.attend(x, rope, forward_batch)
        if keep_rows is not None:
            x, residual = x[keep_rows], residual[keep_rows]
        n = x.shape[0]
        if (n <= packed.CHUNK_ROWS or getattr(forward_batch, "whole_rows", False)
                or not (self.row_slices and self.mlp.fused and self.post_attention_layernorm.fused)):
            return self._after_attention(x, residual)
        # a long prefill runs everything after attention a packed-matmul slice of rows at a time: the
        # slice's activations (its 2 x intermediate gate/up floats per row above all) stay in cache
        # from the output projection through the down projection instead of going out to memory and
        # back, and no slice outputs are concatenated. The fused norm updates its rows of residual in
        # place, so the residual it returns is a view of ours
        out = x.new_empty(n, residual.shape[1])
        for i in range(0, n, packed.CHUNK_ROWS):
            rows = slice(i, i + packed.CHUNK_ROWS)
            out[rows] = self._after_attention(x[rows], residual[rows])[0]
        return out, residual

    def _after_attention(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, the residual add and norm, the MLP: attention output rows -> (mlp output, residual)."""
        x, residual = self.post_attention_layernorm.add_norm(self.self_attn.o_proj(x), residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    layer_cls: type[DecoderLayer] = DecoderLayer
    embed_scale: float | None = None  # Gemma multiplies the embeddings by sqrt(hidden)
    headless = False  # drop_lm_head: an untied base model saved without its head serves hidden states only

    def __init__(self, config: Any, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 tp: TPComm | None = None, methods: WeightMethods = PLAIN) -> None:
        """``methods``: every linear's weight method (layers/weight_methods.py), chosen before loading."""
        super().__init__()
        self.config = config
        self.tp = tp
        vocab, hidden = config.vocab_size, config.hidden_size
        # the parameters are shapes only until materialize_ below: no float32 copy, no random init
        with torch.device("meta"):
            self.embed_tokens = (nn.Embedding(vocab, hidden) if tp is None
                                 else VocabParallelEmbedding(vocab, hidden, tp=tp))
            self.layers = nn.ModuleList(self.layer_cls(config, i, tp, methods) for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
            # tied: the logits read the embedding table, or a copy of it in the methods' own format
            self.lm_head: nn.Module | None
            if self.tie_word_embeddings:
                self.lm_head = methods.head(self.embed_tokens) if tp is None else None
            else:
                self.lm_head = (Linear(hidden, vocab, method=methods.linear(hidden)) if tp is None
                                else ParallelLMHead(vocab, hidden, tp=tp))
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        max_pos = rope_context_length(config)
        self.final_logit_softcap: float | None = getattr(config, "final_logit_softcapping", None) or None
        # one rotary table per kind of layer (Gemma3's sliding layers use another theta): layer i uses
        # table layer_rope[i]; table 0 is (cos_cache, signed_sin_cache), [max_pos, rotary_dim]
        tables, self.layer_rope = self.rope_tables(config, max_pos)
        self.rotary_dim = tables[0][0].shape[1]
        for t, (cos, signed_sin) in enumerate(tables):
            suffix = "" if t == 0 else f"_{t}"
            self.register_buffer("cos_cache" + suffix, cos.to(dtype), persistent=False)
            self.register_buffer("signed_sin_cache" + suffix, signed_sin.to(dtype), persistent=False)
        self.num_rope_tables = len(tables)
        # per table: the prompt length past which prompt positions take other rows (rotary.length_rows)
        self.rope_switch = [rope_switch_point(config, self.rope_table_layer_type(t)) for t in range(len(tables))]
        self.cpu_kernels = False  # see use_cpu_kernels
        materialize_(self, dtype, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [num_tokens] int64 -> hidden [num_tokens, hidden] after the final norm.

        ``keep_rows`` (int64 token rows): return only those rows' hidden states, [len(keep_rows), hidden].
        The last layer then runs its output projection and MLP on those rows alone: a prefill needs the
        logits of its last token, while every token's k and v (written before attention) are still
        cached. On SmolLM2 (30 layers) that skips ~3% of a prefill's matmul work."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        ropes = [self._rotary(positions, t, forward_batch) for t in range(self.num_rope_tables)]
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, ropes[self.layer_rope[i]], forward_batch, keep_rows if i == last else None)
        return self.norm.add_norm(x, residual)[0]

    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        """Each layer's (kv heads on this rank, head_dim): what the KV pool holds per token and layer."""
        return [(layer.self_attn.num_kv_heads, layer.self_attn.head_dim) for layer in self.layers]

    def rope_tables(self, config: Any, max_pos: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
        """The rotary tables and which one each layer uses (one table for every layer here)."""
        rotary_dim = int(self.head_dim * partial_rotary_factor(config))
        return [rope_tables(config, rotary_dim, max_pos)], [0] * config.num_hidden_layers

    def rope_table_layer_type(self, table: int) -> str | None:
        """The layer type whose rotary parameters built table ``table`` (None: the model's only ones)."""
        return None

    def _rotary(self, positions: torch.Tensor, table: int, forward_batch: Any) -> Rotary:
        suffix = "" if table == 0 else f"_{table}"
        cos, sin = getattr(self, "cos_cache" + suffix), getattr(self, "signed_sin_cache" + suffix)
        rows = self._prompt_rows(positions, table, forward_batch)
        if rows is not None:  # this forward's own table: one row per token, read at rows 0..n-1
            idx, prompt_cos, prompt_sin = rows
            cos, sin = cos[positions], sin[positions]
            cos[idx], sin[idx] = prompt_cos.to(cos), prompt_sin.to(sin)
            positions = torch.arange(positions.shape[0], device=positions.device)
        if self.cpu_kernels:
            if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0]):
                raise ValueError(f"positions must lie in [0, {cos.shape[0]})")
            return Rotary(positions, cos, sin, None, None)
        return Rotary(positions, cos, sin, cos[positions][:, None, :], sin[positions][:, None, :])

    def _prompt_rows(self, positions: torch.Tensor, table: int, forward_batch: Any
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(token rows, cos, signed sin) for the prompt tokens of this forward whose rows a length-dependent
        rule takes from their prompt's length rather than their position (rotary.length_rows); None if none."""
        switch, prompt_lens = self.rope_switch[table], getattr(forward_batch, "prompt_lens_cpu", None)
        if switch is None or not prompt_lens or max(prompt_lens) <= switch or forward_batch.forward_mode.is_decode():
            return None
        idx, cos, sin = [], [], []
        start = 0
        for prompt_len, n in zip(prompt_lens, forward_batch.extend_seq_lens_cpu):
            if prompt_len > switch:
                pos = positions[start:start + n].cpu()
                inside = torch.nonzero(pos < prompt_len).flatten()
                if inside.numel():
                    rows = length_rows(self.config, self.rotary_dim, prompt_len, pos[inside],
                                       self.rope_table_layer_type(table))
                    idx.append(inside + start)
                    cos.append(rows[0])
                    sin.append(rows[1])
            start += n
        if not idx:
            return None
        dev = positions.device
        return torch.cat(idx).to(dev), torch.cat(cos).to(dev), torch.cat(sin).to(dev)

    def use_cpu_kernels(self) -> bool:
        """Run the layers' small ops (norms with the residual add, rotary, SiLU-and-multiply) through
        radixlang's compiled CPU kernels. Only float32 weights on the CPU qualify; returns whether the
        kernels are now in use (False: not applicable, or no compiler here)."""
        if self.cos_cache.device.type != "cpu" or self.cos_cache.dtype != torch.float32 or not cpu_ops.available():
            return False
        for m in list(self.modules()):
            if isinstance(m, RMSNorm) or (isinstance(m, MLP) and m.act_name == "silu"):
                m.fused = True
            if isinstance(m, MoEBlock) and isinstance(m.experts, Experts) and m.experts.packable():
                m.pack_experts_()  # its experts (and shared expert) repacked for csrc/moe.c
        self.cpu_kernels = self.rotary_dim == self.head_dim  # the rotary kernel turns whole heads only
        return True

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._logits(hidden)
        if self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.headless:
            raise RuntimeError("this model was loaded without an LM head (its checkpoint has no lm_head.weight and "
                               "unties its embeddings): it serves embeddings only (--is-embedding)")
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.tp is not None:
            return self.embed_tokens.logits(hidden).float()  # gathered over the ranks: [n, vocab]
        return F.linear(hidden, self.embed_tokens.weight).float()  # [n, vocab]

    def drop_lm_head(self) -> None:
        """Before loading: serve hidden states only, from a checkpoint without ``lm_head.weight`` whose
        embeddings are untied (e5-mistral: a MistralModel saved without a head); load_weights then expects
        no head, and the logits raise."""
        if self.tie_word_embeddings:
            raise ValueError("drop_lm_head is for untied embeddings: a tied head is the embedding table itself")
        self.lm_head, self.headless = None, True

    def checkpoint_name(self, name: str) -> str:
        """A hook for families whose checkpoint names a module differently (Mixtral's block_sparse_moe)."""
        return name

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A hook for families whose checkpoint stores a tensor differently (Gemma's norms as w for 1 + w)."""
        return tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors (model.layers.N.self_attn.q_proj.weight, ...), fusing q/k/v and gate/up.

        Each tensor goes whole to its parameter's ``weight_loader`` (with its piece of a fused parameter),
        which keeps this rank's slice under tensor parallelism (models/parallel.py).
        """
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in weights:
            name = self.checkpoint_name(name.removeprefix("model."))
            if "rotary_emb" in name:
                continue
            tensor = self.checkpoint_tensor(name, tensor)
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            pname, shard = expert_checkpoint_param(name) or _checkpoint_param(name)
            if pname not in params:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            param = params[pname]
            weight_loader_of(param)(param, tensor, shard)
            seen.add(pname if shard is None else f"{pname}:{shard}")
        loaded_parts: dict[str, int] = {}
        for key in seen:
            if ":" in key:
                pname = key.split(":", 1)[0]
                loaded_parts[pname] = loaded_parts.get(pname, 0) + 1
        missing = [n for n in params if n not in seen and loaded_parts.get(n, 0) < _parts_expected(n, params[n])]
        if missing:
            raise ValueError(f"weights missing from checkpoint: {missing[:5]}{'...' if len(missing) > 5 else ''}")

    def lora_target(self, module: str) -> tuple[str, Piece] | None:
        """Where a checkpoint's linear (``model.layers.0.self_attn.q_proj``, as a PEFT adapter names it) lives
        here: (the path of the linear serving it, its output columns there), None if no linear serves it."""
        name = self.checkpoint_name(module.removeprefix("model.") + ".weight")
        parts = name.split(".")
        if len(parts) < 2:
            return None
        kind = parts[-2]
        target, shard = _FUSED.get(kind, (kind, None))
        path = ".".join(parts[:-2] + [target])
        try:
            linear = self.get_submodule(path)
        except AttributeError:
            return None
        out = getattr(linear, "out_features", None)
        if not isinstance(out, int):
            return None
        if shard is None:
            return path, Piece(0, out)
        # a fused linear's pieces, as its column loader fills them (models/parallel.py: column_linear)
        return (path, linear.pieces[shard]) if isinstance(linear, Linear) and shard < len(linear.pieces) else None


# checkpoint modules this model serves side by side in one linear: name -> (the fused linear, its shard)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _checkpoint_param(name: str) -> tuple[str, int | None]:
    """The parameter a checkpoint tensor loads into and its piece there: ``layers.0.self_attn.k_proj.weight``
    -> (``layers.0.self_attn.qkv_proj.weight``, 1); any name outside ``_FUSED`` -> (itself, None)."""
    parts = name.split(".")
    if len(parts) < 2 or parts[-2] not in _FUSED:
        return name, None
    target, shard = _FUSED[parts[-2]]
    return ".".join(parts[:-2] + [target, parts[-1]]), shard


def unfused_pieces(name: str, tensor: torch.Tensor, q_size: int,
                   kv_size: int) -> list[tuple[str, torch.Tensor]] | None:
    """A fused ``...qkv_proj.<leaf>`` or ``...gate_up_proj.<leaf>`` tensor cut into the checkpoint pieces
    the loader takes (q/k/v_proj of q_size, kv_size, kv_size rows; gate/up_proj halves); None for any other
    tensor."""
    prefix, _, leaf = name.rpartition(".")
    owner, _, kind = prefix.rpartition(".")
    if kind == "qkv_proj":
        parts = zip(("q_proj", "k_proj", "v_proj"), tensor.split([q_size, kv_size, kv_size]))
    elif kind == "gate_up_proj":
        parts = zip(("gate_proj", "up_proj"), tensor.split(tensor.shape[0] // 2))
    else:
        return None
    return [(f"{owner}.{n}.{leaf}", x) for n, x in parts]


def materialize_(module: nn.Module, dtype: torch.dtype, device: str | torch.device) -> None:
    """Give every parameter still on the meta device uninitialised storage of its final dtype (``dtype``
    for floating-point ones) on ``device``, and move the other parameters and buffers there. The storage
    is filled by ``load_weights``, which refuses a checkpoint that leaves any parameter unset."""
    made: dict[int, nn.Parameter] = {}  # a parameter two modules share (a tied head's table) stays shared
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                dt = dtype if p.is_floating_point() else p.dtype
                data = (torch.empty(p.shape, dtype=dt, device=device) if p.is_meta
                        else p.detach().to(device=device, dtype=dt))
                made[id(p)] = nn.Parameter(data, requires_grad=False)
                if "weight_loader" in p.__dict__:  # the loader it was created with goes with it
                    set_weight_loader(made[id(p)], p.__dict__["weight_loader"])
            m._parameters[name] = made[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = b.to(device=device, dtype=dtype if b.is_floating_point() else b.dtype)


def _parts_expected(name: str, param: torch.Tensor) -> int:
    """How many checkpoint tensors fill a parameter loaded piece by piece (fused or stacked)."""
    if name.endswith("experts.w13"):
        return 2 * param.shape[0]
    if name.endswith("experts.w2"):
        return param.shape[0]
    if ".qkv_proj." in name:
        return 3
    if ".gate_up_proj." in name:
        return 2
    return 1


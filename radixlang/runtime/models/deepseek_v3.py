"""DeepSeek-V3 (and R1): DeepSeek-V2's decoder (layers/mla.py attention, shared experts, dense first
layers) with V3's routing: sigmoid scores, experts picked by score + ``e_score_correction_bias`` among
the ``topk_group`` best of ``n_group`` groups (a group scores its two best biased scores), weighted by
the unbiased scores, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``. The rotary
features are interleaved pairs unless ``rope_interleave`` is false. The FP8 release needs converting
to bf16 first."""
from __future__ import annotations

from typing import Any

import torch

from radixlang.runtime.models.deepseek_v2 import DeepseekMoE, DeepseekV2DecoderLayer, DeepseekV2ForCausalLM
from radixlang.runtime.models.layers.moe import route_sigmoid_grouped


class DeepseekV3MoE(DeepseekMoE):
    sigmoid_routing = True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        assert self.gate.e_score_correction_bias is not None
        return route_sigmoid_grouped(self.gate(x), self.top_k, bias=self.gate.e_score_correction_bias,
                                     n_group=c.n_group, topk_group=c.topk_group,
                                     renormalize=bool(c.norm_topk_prob), scale=float(c.routed_scaling_factor))


class DeepseekV3DecoderLayer(DeepseekV2DecoderLayer):
    moe_cls = DeepseekV3MoE


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    layer_cls = DeepseekV3DecoderLayer

    def __init__(self, config: Any, **kw: Any) -> None:
        super().__init__(config, **kw)
        self.rope_interleaved = bool(getattr(config, "rope_interleave", True))

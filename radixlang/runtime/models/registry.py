"""Model classes by the Hugging Face architecture name in a config's ``architectures``."""
from __future__ import annotations

from typing import Any

from torch import nn

from radixlang.runtime.models.deepseek_v2 import DeepseekV2ForCausalLM
from radixlang.runtime.models.deepseek_v3 import DeepseekV3ForCausalLM
from radixlang.runtime.models.gemma2 import Gemma2ForCausalLM
from radixlang.runtime.models.gemma3 import Gemma3ForCausalLM
from radixlang.runtime.models.gpt_oss import GptOssForCausalLM
from radixlang.runtime.models.llama import LlamaForCausalLM
from radixlang.runtime.models.mistral import MistralForCausalLM
from radixlang.runtime.models.mixtral import MixtralForCausalLM
from radixlang.runtime.models.phi3 import Phi3ForCausalLM
from radixlang.runtime.models.qwen2 import Qwen2ForCausalLM
from radixlang.runtime.models.qwen2_moe import Qwen2MoeForCausalLM
from radixlang.runtime.models.qwen3 import Qwen3ForCausalLM
from radixlang.runtime.models.qwen3_moe import Qwen3MoeForCausalLM

# Llama derivatives that differ from it only by config values load as Llama
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def model_class(config: Any) -> type[nn.Module]:
    """The class for the config's architecture; a ValueError listing the supported ones otherwise.

    A base model (``LlamaModel``: what sentence-transformers saves an embedding model as, its weights
    named without ``model.``) loads as its causal LM; the loader reads either naming."""
    archs = list(getattr(config, "architectures", None) or ["LlamaForCausalLM"])
    for arch in archs:
        causal = arch.removesuffix("Model") + "ForCausalLM" if arch.endswith("Model") else arch
        if causal in MODEL_CLASSES:
            return MODEL_CLASSES[causal]
    raise ValueError(f"architecture {archs} is not supported (supported: {', '.join(sorted(MODEL_CLASSES))})")

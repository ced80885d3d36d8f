"""Model registry: Hugging Face ``architectures`` name -> model class."""

from __future__ import annotations

from torch import nn

from llmserve.models.gemma3 import Gemma3ForCausalLM
from llmserve.models.llama import LlamaForCausalLM
from llmserve.models.mixtral import MixtralForCausalLM
from llmserve.models.phi3 import Phi3ForCausalLM
from llmserve.models.qwen2_moe import Qwen2MoeForCausalLM
from llmserve.models.qwen3 import Qwen3ForCausalLM
from llmserve.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class implementing ``architecture`` (e.g. ``"LlamaForCausalLM"``).

    Raises:
        ValueError: for an unsupported architecture; the message names it and
            lists the supported ones.
    """
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported model architecture {architecture!r}; "
                         f"supported: {sorted(MODEL_REGISTRY)}") from None

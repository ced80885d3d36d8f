"""Model registry: Hugging Face ``architectures`` name -> model class."""

from __future__ import annotations

from torch import nn

from llmserve.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
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

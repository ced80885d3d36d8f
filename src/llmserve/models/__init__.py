"""llmserve.models: model implementations and the architecture registry."""

from llmserve.models.llama import LlamaForCausalLM
from llmserve.models.registry import MODEL_REGISTRY, get_model_class

__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "get_model_class"]

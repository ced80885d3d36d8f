"""Multi-LoRA serving: PEFT adapters batched in one step (see :mod:`llmserve.lora.layers`).

Torch-free at import (``LoRARequest`` is used by the engine front and the server); the
worker side is :mod:`llmserve.lora.manager`.
"""

from llmserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]

"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter for one request.

    Args:
        lora_name: the adapter's name (the OpenAI ``model`` field on the server); it keys
            the prefix cache, so two adapters never share cached KV.
        lora_int_id: a positive id, unique per adapter (vLLM's convention; 0 = no adapter).
        lora_path: a PEFT adapter directory (``adapter_config.json`` +
            ``adapter_model.safetensors``).

    Raises:
        ValueError: for an empty name or path, or an id < 1.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty path")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

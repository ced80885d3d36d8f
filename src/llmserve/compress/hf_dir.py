"""Write a transformers model as a Hugging Face directory that transformers and
llmserve load: ``model.safetensors`` (float32), ``config.json`` and the tokenizer.

Written by hand because ``save_pretrained`` refuses a model transformers read from a
GGUF file; a tied LM head is written once (as the embedding).
"""

from __future__ import annotations

import json
import os
from typing import Any


def save_hf_dir(model: Any, tokenizer: Any, output: str,
                config_extra: dict[str, Any] | None = None) -> str:
    """Write ``model`` and ``tokenizer`` to ``output``; ``config_extra``: keys added to
    ``config.json`` (e.g. ``sparsity_config``). Returns ``output``.

    Raises:
        ValueError: ``output`` is a file.
    """
    if os.path.isfile(output):
        raise ValueError(f"--output {output!r} is a file; pass a directory")
    from safetensors.torch import save_file

    os.makedirs(output, exist_ok=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {name: t.detach().float().contiguous() for name, t in model.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    save_file(tensors, os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    for key in ("dtype", "quantization_config", "_name_or_path"):
        config.pop(key, None)
    config.update(config_extra or {})
    with open(os.path.join(output, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    tokenizer.save_pretrained(output)
    return output

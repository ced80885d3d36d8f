"""Phi-3 / Phi-3.5 / Phi-4-mini (``Phi3ForCausalLM``): the Llama block, fused in the checkpoint.

The checkpoint already stores ``self_attn.qkv_proj`` (rows ``| q | k | v |``) and
``mlp.gate_up_proj`` (rows ``| gate | up |``), the layouts of our fused layers, so
they load whole instead of being stacked from q/k/v and gate/up. RoPE is
"longrope" for the 128k variants (short factors up to
``original_max_position_embeddings``, long factors beyond; the legacy type names
"su" and "yarn" mean longrope here, as in ``Phi3Config``) and may rotate only
``partial_rotary_factor`` of each head (Phi-4-mini: 0.75). Numerics follow
``transformers`` ``modeling_phi3``.
"""

from __future__ import annotations

from llmserve.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 causal LM; arguments and errors as :class:`~llmserve.models.llama.LlamaForCausalLM`."""

    # qkv_proj and gate_up_proj are fused in the checkpoint: every name maps to itself
    packed_modules_mapping: dict[str, list[tuple[str, int | str]]] = {}

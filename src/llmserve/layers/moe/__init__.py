"""Mixture-of-experts layers: top-k router, expert-grouped fused expert loop, sparse block."""

from llmserve.layers.moe.fused_moe import FusedMoE, fused_experts, moe_align
from llmserve.layers.moe.router import select_experts
from llmserve.layers.moe.sparse_moe_block import SparseMoeBlock

__all__ = ["FusedMoE", "SparseMoeBlock", "fused_experts", "moe_align", "select_experts"]

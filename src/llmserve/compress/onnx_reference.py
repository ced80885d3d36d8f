"""A plain-PyTorch decoder with the KV cache as explicit inputs and outputs (for ONNX).

Not the paged engine: one dense forward per call, written so that ``torch.onnx.export``
traces it into standard ops. Inputs and outputs are named as optimum and
onnxruntime-genai name them::

    input_ids              int64 [batch, sequence_length]
    attention_mask         int64 [batch, total_sequence_length]   (1 = attend, 0 = pad)
    position_ids           int64 [batch, sequence_length]
    past_key_values.N.key  float32 [batch, num_kv_heads, past_sequence_length, head_dim]
    past_key_values.N.value                                     (same)
    ->
    logits                 float32 [batch, sequence_length, vocab_size]
    present.N.key          float32 [batch, num_kv_heads, total_sequence_length, head_dim]
    present.N.value        (same; total = past + sequence_length)

The math is Hugging Face's ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM`` (RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU MLP;
Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm), in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.config import ModelConfig

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM")


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """``(input names, output names)`` of the exported decoder."""
    inputs = ["input_ids", "attention_mask", "position_ids"]
    outputs = ["logits"]
    for i in range(num_layers):
        inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ReferenceDecoder(nn.Module):
    """``forward(input_ids, attention_mask, position_ids, *past) -> (logits, *present)``
    with ``past`` / ``present`` flattened as ``[key_0, value_0, key_1, ...]`` (see the
    module doc for shapes).

    Raises:
        ValueError: an architecture outside :data:`ARCHITECTURES`, RoPE scaling other than
            linear, or a missing weight.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        if config.architecture not in ARCHITECTURES:
            raise ValueError(f"--format onnx supports {list(ARCHITECTURES)}, not "
                             f"{config.architecture!r}")
        scaling = config.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in (None, "default", "linear"):
            raise ValueError(f"--format onnx: rope_scaling {kind!r} is not supported "
                             "(linear or none)")
        self.config = config
        self.head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        self.pos_scale = 1.0 / float(scaling["factor"]) if kind == "linear" else 1.0
        inv_freq = 1.0 / (config.rope_theta ** (
            torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.params = nn.ParameterDict()
        for name, t in weights.items():
            self.params[name.replace(".", "__")] = nn.Parameter(
                t.detach().float().contiguous(), requires_grad=False)
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            self.params["lm_head__weight"] = self.params["model__embed_tokens__weight"]

    def w(self, name: str) -> torch.Tensor | None:
        key = name.replace(".", "__")
        return self.params.get(key, None)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = torch.matmul(x, self.w(f"{name}.weight").t())
        bias = self.w(f"{name}.bias")
        return y if bias is None else y + bias

    def _attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   mask: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        p = f"model.layers.{i}.self_attn"
        b, s, _ = x.shape
        hd, nh, nkv = self.head_dim, c.num_attention_heads, c.num_key_value_heads
        q = self._linear(x, f"{p}.q_proj").view(b, s, nh, hd).transpose(1, 2)
        k = self._linear(x, f"{p}.k_proj").view(b, s, nkv, hd).transpose(1, 2)
        v = self._linear(x, f"{p}.v_proj").view(b, s, nkv, hd).transpose(1, 2)
        if self.w(f"{p}.q_norm.weight") is not None:  # Qwen3 QK-norm
            q = _rms_norm(q, self.w(f"{p}.q_norm.weight"), c.rms_norm_eps)
            k = _rms_norm(k, self.w(f"{p}.k_norm.weight"), c.rms_norm_eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        key = torch.cat([past_key, k], dim=2)  # [b, nkv, total, hd]
        value = torch.cat([past_value, v], dim=2)
        groups = nh // nkv
        kx = key[:, :, None].expand(b, nkv, groups, key.shape[2], hd).reshape(b, nh, -1, hd)
        vx = value[:, :, None].expand(b, nkv, groups, value.shape[2], hd).reshape(b, nh, -1, hd)
        scores = torch.matmul(q, kx.transpose(2, 3)) * (hd ** -0.5)  # [b, nh, s, total]
        scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
        out = torch.matmul(torch.softmax(scores, dim=-1), vx)  # [b, nh, s, hd]
        out = out.transpose(1, 2).reshape(b, s, nh * hd)
        return self._linear(out, f"{p}.o_proj"), key, value

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = self.config
        x = self.w("model.embed_tokens.weight")[input_ids]  # [b, s, hidden]
        s = input_ids.shape[1]
        total = attention_mask.shape[1]
        freqs = (position_ids.float() * self.pos_scale)[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [b, 1, s, hd]
        cos, sin = emb.cos(), emb.sin()
        q_pos = torch.arange(s, device=input_ids.device) + (total - s)
        k_pos = torch.arange(total, device=input_ids.device)
        causal = k_pos[None, :] <= q_pos[:, None]  # [s, total]
        mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        present: list[torch.Tensor] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}"
            h = _rms_norm(x, self.w(f"{p}.input_layernorm.weight"), c.rms_norm_eps)
            a, key, value = self._attention(i, h, cos, sin, mask, past[2 * i], past[2 * i + 1])
            present += [key, value]
            x = x + a
            h = _rms_norm(x, self.w(f"{p}.post_attention_layernorm.weight"), c.rms_norm_eps)
            gate = self._linear(h, f"{p}.mlp.gate_proj")
            up = self._linear(h, f"{p}.mlp.up_proj")
            x = x + self._linear(torch.nn.functional.silu(gate) * up, f"{p}.mlp.down_proj")
        x = _rms_norm(x, self.w("model.norm.weight"), c.rms_norm_eps)
        logits = torch.matmul(x, self.w("lm_head.weight").t())
        return (logits, *present)

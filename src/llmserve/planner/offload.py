"""Weights and KV of llmserve's CPU offload and layer split, per device (pure Python).

Mirrors ``llmserve.worker.layer_split.install_offload`` (the engine)::

    device layers   = num_device_layers (default all)    KV per token on the device x n / L
    offloaded       = k = min(n, floor(cpu_offload_gb / layer bytes))   whole layers
    device weights  = (n - k) x layer + min(k, 2) x layer (staging slots)
                      + embeddings, final norm, LM head   (only when n = L)
    host weights    = everything else
    host -> device  = k x layer bytes per forward pass

Layer bytes are the ledger's (every decoder layer alike: ``(total - embeddings - lm_head -
final norm) / L``).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.planner.formats import WeightFormat
from llmserve.planner.ledger import weight_bytes
from llmserve.planner.model import PlannerModel


@dataclass(frozen=True)
class WeightSplit:
    """Where the weights of one engine live (bytes)."""

    num_layers: int
    num_device_layers: int
    offloaded_layers: int
    layer_bytes: int
    device_weight_bytes: int
    host_weight_bytes: int
    staging_bytes: int

    @property
    def bytes_per_forward(self) -> int:
        """Host -> device weight bytes per forward pass (each engine step)."""
        return self.offloaded_layers * self.layer_bytes

    def host_kv_bytes_per_token(self, kv_bytes_per_token: int) -> int:
        """The CPU layers' share of ``kv_bytes_per_token`` (all layers)."""
        return kv_bytes_per_token * (self.num_layers - self.num_device_layers) // self.num_layers


def split_weights(m: PlannerModel, total_bytes: int, fmt: WeightFormat,
                  cpu_offload_gb: float = 0.0,
                  num_device_layers: int | None = None) -> WeightSplit:
    """Split ``total_bytes`` of ``m``'s weights between the device and host memory.

    Raises:
        ValueError: a negative ``cpu_offload_gb`` or one above ``total_bytes``;
            ``num_device_layers`` outside ``1..num_hidden_layers`` (0 leaves the device
            nothing to plan).
    """
    num_layers = m.num_hidden_layers
    if isinstance(cpu_offload_gb, bool) or not isinstance(cpu_offload_gb, (int, float)) \
            or cpu_offload_gb < 0:
        raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0, got {cpu_offload_gb!r}")
    budget = int(cpu_offload_gb * 1024**3)
    if budget > total_bytes:
        raise ValueError(f"cpu_offload_gb={cpu_offload_gb} is more than the model's weights "
                         f"({total_bytes / 1024**3:.3f} GiB)")
    n = num_layers if num_device_layers is None else num_device_layers
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= num_layers:
        raise ValueError(f"num_device_layers must be in 1..{num_layers} for planning, "
                         f"got {num_device_layers!r}")
    ledger = weight_bytes(m, fmt).by_component
    outer_share = (ledger.get("embeddings", 0) + ledger.get("lm_head", 0)
                   + 2 * m.hidden_size) / max(sum(ledger.values()), 1)
    outer = int(total_bytes * outer_share)
    layer = (total_bytes - outer) // num_layers
    k = min(n, budget // layer) if layer else 0
    staging = min(k, 2) * layer
    device = (n - k) * layer + staging + (outer if n == num_layers else 0)
    return WeightSplit(num_layers, n, k, layer, device, total_bytes - device + staging,
                       staging)

"""gguf-hybrid's prompt rows: a dense GEMM in fixed 64-row chunks, on a weight that
oneDNN has packed once at load.

Every call has one shape (``[DENSE_CHUNK_ROWS, K] x [K, N]``, the last chunk padded
with zero rows), so a row's bits never depend on how many rows share its step
(oneDNN picks its kernel by M; with AMX its bf16 GEMM changes blocking with M: seen
at N 576, K 1536, M 40 vs 2). That is the batch invariance of issue 20.

``F.linear`` on a plain ``[N, K]`` weight reorders the whole weight into oneDNN's
blocked (AMX/VNNI) layout on every call: at 64 rows that costs as much as the GEMM
itself. :class:`PrepackedDenseWeight` does the reorder once
(``torch.ops.mkldnn._reorder_linear_weight``, PyTorch's own path for frozen CPU
graphs, Inductor's ``mkldnn_fusion``) and multiplies with
``torch.ops.mkldnn._linear_pointwise``. Measured (Intel Xeon with AMX, 2 threads,
bf16, 512 rows as 64-row calls): gate_up 17920 x 1536 861 -> 1737 GFLOP/s; the
packed kernel gives each row the same bits for any rows beside it, as the plain one
does (tests/test_batch_invariance.py). Used for bfloat16 only (float32 gguf-hybrid is
the exact checking path) and where the build has oneDNN.
"""

from __future__ import annotations

import torch

from llmserve.layers.batch_invariant import chunked_linear

# rows per GEMM call (a prompt chunk of 512 tokens is 8 calls)
DENSE_CHUNK_ROWS = 64


def dense_linear(x: torch.Tensor, weight: torch.Tensor | PrepackedDenseWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T + bias`` -> ``[M, N]`` in chunks of exactly
    :data:`DENSE_CHUNK_ROWS` rows (zero-padded), a plain or a prepacked weight."""
    if isinstance(weight, PrepackedDenseWeight):
        return weight.linear(x, bias)
    return chunked_linear(x, weight, bias, chunk_rows=DENSE_CHUNK_ROWS)


def can_prepack(weight: torch.Tensor) -> bool:
    """True where :class:`PrepackedDenseWeight` takes ``weight``: a 2-D bfloat16 CPU
    tensor with memory, in a build with oneDNN, on a CPU where oneDNN runs bf16."""
    return (weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())  # oneDNN's bf16 needs the ISA


class PrepackedDenseWeight:
    """A ``[N, K]`` bfloat16 weight in oneDNN's blocked layout for ``DENSE_CHUNK_ROWS``-row
    GEMMs (module doc). The plain weight can be dropped once this exists.

    Raises:
        ValueError: a weight :func:`can_prepack` refuses.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        if not can_prepack(weight):
            raise ValueError(f"cannot prepack a {weight.dtype} {tuple(weight.shape)} weight on "
                             f"{weight.device} (bfloat16 2-D CPU with oneDNN only)")
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(),
                                                              DENSE_CHUNK_ROWS)

    def nbytes(self) -> int:
        return self.out_features * self.in_features * 2

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]`` (``x``'s dtype must be bfloat16)."""
        return chunked_linear(x, self.packed, bias, DENSE_CHUNK_ROWS, _packed_linear)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk through oneDNN's packed-weight GEMM (contiguous rows, as it reads them)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")

"""Typed wrappers over the GGUF block-matmul kernels (``cpu_kernels.c``: Q8_0, and the
Q5_0 / Q4_K / Q5_K / Q6_K blocks of ``gguf_matmul``; ``cpu_kernels_vnni.c`` and
``cpu_kernels_x16.c``: Q8_K activations x repacked Q4_K / Q6_K), mixed into
:class:`~llmserve.kernels.cpu.CpuKernels`. Block layouts are ggml's (``ggml-common.h``);
each wrapper checks shapes and dtypes and the C side checks the rest (a status)."""

from __future__ import annotations

import torch

from llmserve.kernels.cpu_abi import GGUF_MATMUL_TYPES, X16_TILE_BYTES, _code, check_status
from llmserve.kernels.hugepages import hugepage_empty


def _gguf_call_args(what: str, layout: tuple[int, int, int] | None, qtype: str,
                    x: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor | None):
    """``(layout, dtype code, out)`` for a block matmul of ``x [M, K]`` (1 <= M <= 16,
    unit column stride) by ``blocks [N, K / weights_per_block * block_bytes]`` (uint8,
    CPU, contiguous); ``out`` allocated ``[M, N]`` in ``x``'s dtype when None.

    Raises:
        ValueError: an unknown type (``layout`` None), or shapes, strides, dtypes.
    """
    num_rows, k = x.shape
    n = blocks.shape[0]
    if layout is None or blocks.dtype != torch.uint8 or x.stride(1) != 1 or \
            k % layout[1] or blocks.shape != (n, k // layout[1] * layout[2]) or \
            not blocks.is_contiguous() or not 1 <= num_rows <= 16 or not blocks.is_cpu:
        raise ValueError(f"{what}: {qtype} x {tuple(x.shape)}, blocks "
                         f"{tuple(blocks.shape)} {blocks.dtype}")
    return (layout, *_code_and_out(what, x, out, n))


def _code_and_out(what: str, x: torch.Tensor, out: torch.Tensor | None, n: int):
    """``(dtype code, out)``: ``out`` checked as ``[M, n]`` with contiguous rows in ``x``'s
    dtype, or allocated when None.

    Raises:
        ValueError: ``out``'s shape, strides or dtype.
    """
    num_rows = x.shape[0]
    code = _code(x) if out is None else _code(x, out)
    if out is None:
        out = x.new_empty((num_rows, n))
    elif out.shape != (num_rows, n) or out.stride(1) != 1:
        raise ValueError(f"{what}: out {tuple(out.shape)} strides {out.stride()}, "
                         f"expected [{num_rows}, {n}] with contiguous rows")
    return code, out


class GgufMatmulKernels:
    """The GGUF matmul wrappers of :class:`~llmserve.kernels.cpu.CpuKernels` (it binds
    the ``_<name>`` ctypes functions these call)."""

    def q8_0_matmul(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    num_threads: int = 1) -> torch.Tensor:
        """``x W^T`` for a GGUF Q8_0 weight ``W = d * q`` kept as its blocks.

        Args:
            x: ``[M, K]`` (rows may be strided), ``1 <= M <= 16``.
            codes: int8 ``[N, K]`` contiguous; scales: float32 ``[N, K / 32]`` contiguous.

        Returns:
            ``[M, N]`` in ``x``'s dtype; float32 products and sums (each ``q * x`` exact).

        Raises:
            ValueError: shapes, dtypes or M outside 1..16.
        """
        num_rows, k = x.shape
        n = codes.shape[0]
        if codes.dtype != torch.int8 or scales.dtype != torch.float32 or x.stride(1) != 1 or \
                codes.shape != (n, k) or scales.shape != (n, k // 32) or k % 32 or \
                not (codes.is_contiguous() and scales.is_contiguous()) or \
                not 1 <= num_rows <= 16 or not (codes.is_cpu and scales.is_cpu):
            raise ValueError(f"q8_0_matmul: x {tuple(x.shape)}, codes {tuple(codes.shape)} "
                             f"{codes.dtype}, scales {tuple(scales.shape)} {scales.dtype}")
        code = _code(x)
        out = x.new_empty((num_rows, n))
        check_status(self._q8_0_matmul(code, out.data_ptr(), x.data_ptr(), x.stride(0),
                                 codes.data_ptr(), scales.data_ptr(), num_rows, n, k,
                                 num_threads), "q8_0_matmul")
        return out

    def gguf_matmul(self, qtype: str, x: torch.Tensor, blocks: torch.Tensor,
                    num_threads: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T`` for a GGUF weight ``W [N, K]`` read straight from its blocks.

        Args:
            qtype: one of :data:`GGUF_MATMUL_TYPES` (``"Q4_K"``, ``"Q5_K"``, ``"Q6_K"``,
                ``"Q5_0"``, ``"Q8_0"``).
            x: ``[M, K]`` (rows may be strided), ``1 <= M <= 16``.
            blocks: uint8 ``[N, K / block_weights * block_bytes]`` contiguous (the file's
                bytes, row by row).
            out: optional ``[M, N]`` destination in ``x``'s dtype (rows may be strided,
                e.g. a column slice of a fused layer's output).

        Returns:
            ``[M, N]`` in ``x``'s dtype. Each weight is formed as ``q * s - o`` in float32,
            equal to ``gguf.quants`` bit for bit; products and sums in float32.

        Raises:
            ValueError: unknown type, shapes, dtypes or M outside 1..16.
        """
        layout, code, out = _gguf_call_args("gguf_matmul", GGUF_MATMUL_TYPES.get(qtype), qtype,
                                            x, blocks, out)
        num_rows, k = x.shape
        n = blocks.shape[0]
        check_status(self._gguf_matmul(layout[0], code, out.data_ptr(), out.stride(0),
                                       x.data_ptr(), x.stride(0), blocks.data_ptr(), num_rows,
                                       n, k, num_threads), "gguf_matmul")
        return out

    @property
    def has_q8k_dot(self) -> bool:
        """True where :meth:`gguf_matmul_x16` runs (built with AVX512-VNNI, CPU has it)."""
        return bool(self._gguf_q8k_available())

    def gguf_repack_x16(self, qtype: str, blocks: torch.Tensor) -> torch.Tensor:
        """A GGUF Q4_K / Q6_K / Q8_0 / Q5_0 weight's blocks ``[N, K / B * block_bytes]``
        (uint8, the file's bytes; B = 256 weights a block, 32 for Q8_0 / Q5_0) -> its x16
        tiles ``[ceil(N / 16), K / B * tile_bytes]`` uint8 for :meth:`gguf_matmul_x16`
        (layouts: cpu_kernels_x16.c, cpu_kernels_x16_q32.c; as many bytes a row-block as
        the file, 148 for Q4_K's 144; rows past N are zero), on transparent huge pages
        (:mod:`~llmserve.kernels.hugepages`: decode streams them every step).

        Raises:
            ValueError: another type, a shape that is not whole blocks, a non-CPU tensor.
        """
        layout = GGUF_MATMUL_TYPES.get(qtype)
        n = blocks.shape[0]
        if qtype not in X16_TILE_BYTES or blocks.dtype != torch.uint8 or blocks.dim() != 2 or \
                blocks.shape[1] % layout[2] or not blocks.is_contiguous() or not blocks.is_cpu:
            raise ValueError(f"gguf_repack_x16: {qtype} blocks {tuple(blocks.shape)} {blocks.dtype}")
        num_blocks = blocks.shape[1] // layout[2]
        tiles = hugepage_empty(((n + 15) // 16, num_blocks * X16_TILE_BYTES[qtype]))
        check_status(self._gguf_repack_x16(layout[0], blocks.data_ptr(), n,
                                           num_blocks * layout[1], tiles.data_ptr()),
                     "gguf_repack_x16")
        return tiles

    def gguf_matmul_x16(self, qtype: str, x: torch.Tensor, tiles: torch.Tensor, n: int,
                        num_threads: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T`` for a GGUF Q4_K / Q6_K / Q8_0 / Q5_0 weight with ``x`` quantized to int8
        per row and integer dot products (AVX512-VNNI) on the x16 tiles of
        :meth:`gguf_repack_x16`: one VNNI dot product serves 16 weight rows
        (cpu_kernels_x16.c). llama.cpp's schemes: Q4_K / Q6_K with Q8_K activations (one
        float32 scale per 256 values; ``ggml_vec_dot_q4_K_q8_K``), Q8_0 / Q5_0 with one
        scale per 32 (``ggml_vec_dot_q8_0_q8_0``). A row with a 256-value span whose max
        |x| exceeds 32 times its mean |x| (massive activations) gets a second pass of its
        rounding residual, so such blocks keep about 15 bits of their range instead of 8.

        Args:
            qtype: ``"Q4_K"``, ``"Q6_K"`` (``K % 256 == 0``), ``"Q8_0"`` or ``"Q5_0"``
                (``K % 32 == 0``).
            x: ``[M, K]`` (rows may be strided), ``1 <= M <= 16``.
            tiles: uint8 from :meth:`gguf_repack_x16`.
            n: the weight's rows N.
            out: optional ``[M, N]`` destination in ``x``'s dtype (rows may be strided).

        Returns:
            ``[M, N]`` in ``x``'s dtype: exact integer block sums times float32 scales,
            summed in float32 in a fixed order (a row's result never depends on the others).

        Raises:
            ValueError: another type, shapes, dtypes, M outside 1..16, or no AVX512-VNNI.
        """
        num_rows, k = x.shape
        block = GGUF_MATMUL_TYPES[qtype][1] if qtype in X16_TILE_BYTES else 0
        if not block or tiles.dtype != torch.uint8 or x.stride(1) != 1 or k % block or \
                tiles.shape != ((n + 15) // 16, k // block * X16_TILE_BYTES[qtype]) or \
                not tiles.is_contiguous() or not 1 <= num_rows <= 16 or not tiles.is_cpu:
            raise ValueError(f"gguf_matmul_x16: {qtype} x {tuple(x.shape)}, tiles "
                             f"{tuple(tiles.shape)} {tiles.dtype} for {n} rows")
        code, out = _code_and_out("gguf_matmul_x16", x, out, n)
        status = self._gguf_matmul_x16(GGUF_MATMUL_TYPES[qtype][0], code, out.data_ptr(),
                                       out.stride(0), x.data_ptr(), x.stride(0),
                                       tiles.data_ptr(), num_rows, n, k, num_threads)
        if status == -5:
            raise ValueError("gguf_matmul_x16: this CPU or build has no AVX512-VNNI")
        check_status(status, "gguf_matmul_x16")
        return out

    def q8k_quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Q8_K activation quantization of :meth:`gguf_matmul_x16`: ``x [M, K]`` ->
        int8 codes ``[M, K]`` and float32 scales ``[M, K / 256]`` (``x ~ codes * scale``).

        Raises:
            ValueError: ``K % 256 != 0`` or a non-contiguous last dimension.
        """
        num_rows, k = x.shape
        if k % 256 or x.stride(1) != 1 or num_rows < 1:
            raise ValueError(f"q8k_quantize: x {tuple(x.shape)} (K a multiple of 256)")
        codes = torch.empty((num_rows, k), dtype=torch.int8)
        scales = torch.empty((num_rows, k // 256), dtype=torch.float32)
        check_status(self._q8k_quantize(_code(x), x.data_ptr(), x.stride(0), num_rows, k,
                                        codes.data_ptr(), scales.data_ptr()), "q8k_quantize")
        return codes, scales

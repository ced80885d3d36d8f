"""CPU kernels in C: fused RMSNorm, RoPE, SwiGLU, KV cache writes, paged decode attention.

Eager PyTorch spends most of a small-batch decode step dispatching a dozen
elementwise ops per layer (~2 us each). These kernels do each fused op in one
call (~1 us through ctypes) and read paged K/V in place instead of gathering
it. ``cpu_kernels.c`` is compiled once per machine with the system C compiler
(``$CC``, else ``cc``; ``-O3 -march=native``) into
``$LLMSERVE_CACHE_DIR/kernels/<hash>/`` (default ``~/.cache/llmserve``) and
loaded with ctypes; about 1-2 s the first time.

Where no compiler works, or ``LLMSERVE_CPU_KERNELS=0`` is set,
:func:`get_cpu_kernels` returns None and the layers run their PyTorch code
(the reference the kernels are tested against)::

    kernels = get_cpu_kernels()
    if kernels is not None and kernels.supports(x):
        out = kernels.silu_and_mul(x)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

from llmserve.kernels.cpu import CpuKernels

__all__ = ["CpuKernels", "build_cpu_kernels", "get_cpu_kernels"]

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.c")
# included by cpu_kernels.c: part of the source hash
_INCLUDES = [os.path.join(os.path.dirname(_SOURCE), name)
             for name in ("cpu_kernels_attn.c", "cpu_kernels_attn_scores.c", "cpu_kernels_kvq.c",
                          "cpu_kernels_kvc.c",
                          "cpu_kernels_vnni.c", "cpu_kernels_x16.c",
                          "cpu_kernels_x16_q32.c", "cpu_kernels_x16_pass2.c")]
_BASE_FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp-simd", "-fno-math-errno", "-lm"]
_OPENMP_FLAGS = ["-fopenmp"]  # threads from the libgomp PyTorch already loaded (see the C)
_NATIVE_FLAGS = ["-march=native"]


def _cache_root() -> str:
    root = os.environ.get("LLMSERVE_CACHE_DIR",
                          os.path.join(os.path.expanduser("~"), ".cache", "llmserve"))
    if not root:  # LLMSERVE_CACHE_DIR="" turns the caches off: build in a temp dir
        root = os.path.join(tempfile.gettempdir(), f"llmserve-{os.getuid()}")
    return os.path.join(root, "kernels")


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _compile(cc: str, flags: list[str], out: str) -> str | None:
    """Compile to ``out``; None on success, else the compiler's message."""
    cmd = [cc, _SOURCE, "-o", out, *flags]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if proc.returncode == 0 else (proc.stderr or proc.stdout)[-2000:]


def build_cpu_kernels(cache_dir: str | None = None, native: bool = True) -> str:
    """Compile ``cpu_kernels.c`` (once; later calls find the cached library).

    Args:
        cache_dir: where to keep the library (default ``$LLMSERVE_CACHE_DIR/kernels``).
        native: try ``-march=native`` first (AVX-512 code paths where the CPU has them);
            False builds the portable C only.

    Returns:
        The shared library's path.

    Raises:
        RuntimeError: no C compiler, or it failed with and without ``-march=native``
            (the message has the compiler's output).
    """
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    with open(_SOURCE, "rb") as f:
        source = f.read()
    for path in _INCLUDES:
        with open(path, "rb") as f:
            source += f.read()
    errors = []
    attempts = [_BASE_FLAGS + _OPENMP_FLAGS + _NATIVE_FLAGS, _BASE_FLAGS + _NATIVE_FLAGS,
                _BASE_FLAGS + _OPENMP_FLAGS, _BASE_FLAGS]
    if not native:
        attempts = attempts[2:]
    for flags in attempts:
        key = hashlib.sha256(source + repr((cc, flags, platform.machine(),
                                            _cpu_signature())).encode()).hexdigest()[:16]
        folder = os.path.join(cache_dir or _cache_root(), key)
        lib = os.path.join(folder, "libllmserve_cpu.so")
        if os.path.isfile(lib):
            return lib
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        err = _compile(cc, flags, tmp)
        if err is None:
            os.replace(tmp, lib)  # atomic: a concurrent build or reader sees all or nothing
            logger.info("built CPU kernels: %s", lib)
            return lib
        os.unlink(tmp)
        with contextlib.suppress(OSError):  # leave no empty folder behind
            os.rmdir(folder)
        errors.append(f"{cc} {' '.join(flags)}:\n{err}")
    raise RuntimeError("could not compile the llmserve CPU kernels:\n" + "\n".join(errors))


@functools.lru_cache(maxsize=1)
def get_cpu_kernels() -> CpuKernels | None:
    """The loaded kernels, or None (disabled by ``LLMSERVE_CPU_KERNELS=0``, or no
    working C compiler: a warning says so once and the PyTorch code runs)."""
    if os.environ.get("LLMSERVE_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no",
                                                                       "off"):
        return None
    try:
        path = build_cpu_kernels()
        return CpuKernels(ctypes.CDLL(path))
    except (RuntimeError, OSError) as e:
        logger.warning("CPU kernels unavailable, using PyTorch ops (slower): %s", e)
        return None

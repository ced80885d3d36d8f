"""hugepage_empty: the memory is what the kernel says it is (``/proc/self/smaps``)."""

import mmap
import sys

import pytest
import torch

from llmserve.kernels.hugepages import CHUNK_BYTES, HUGE_PAGE, hugepage_empty

linux_thp = pytest.mark.skipif(not sys.platform.startswith("linux")
                               or not hasattr(mmap, "MADV_HUGEPAGE"),
                               reason="MADV_HUGEPAGE is Linux-only")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds ``address``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@linux_thp
@pytest.mark.parametrize("shape,dtype", [((3, 1000), torch.uint8), ((7, 33), torch.float32),
                                         ((CHUNK_BYTES // 2,), torch.uint8)])
def test_tensors_are_advised_aligned_and_disjoint(shape, dtype):
    a, b = hugepage_empty(shape, dtype), hugepage_empty(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.is_contiguous()
    assert a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0
    nbytes = a.numel() * a.element_size()
    assert abs(a.data_ptr() - b.data_ptr()) >= nbytes  # no overlap
    assert a.untyped_storage().nbytes() == nbytes  # its own storage (weights are counted so)
    assert "hg" in _vm_flags(a.data_ptr())  # madvise(MADV_HUGEPAGE) reached the kernel
    if nbytes > CHUNK_BYTES // 4:
        assert a.data_ptr() % HUGE_PAGE == 0  # a mapping of its own, on a 2 MiB boundary
    a.fill_(1)
    b.fill_(2)
    assert (a == 1).all() and (b == 2).all()


@linux_thp
def test_memory_outlives_the_arena_chunk():
    views = [hugepage_empty((CHUNK_BYTES // 8,)) for _ in range(12)]  # spans 2+ chunks
    for i, v in enumerate(views):
        v.fill_(i)
    assert [int(v[-1]) for v in views] == list(range(12))


def test_negative_shape_is_an_error():
    with pytest.raises(ValueError, match="negative"):
        hugepage_empty((2, -1))

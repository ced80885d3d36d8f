"""Process groups, collectives and worker launch for tensor parallelism.

Nothing here is a module-level "current group": :class:`ParallelGroups` is built once
per process by :func:`init_parallel_groups` and passed explicitly to the layers and the
runner (DESIGN.md section 8). Depends only on ``config`` and torch.
"""

from llmserve.distributed.parallel_state import (
    GroupCoordinator,
    ParallelGroups,
    init_parallel_groups,
)

__all__ = ["GroupCoordinator", "ParallelGroups", "init_parallel_groups"]

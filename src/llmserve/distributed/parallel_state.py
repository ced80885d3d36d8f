"""Process groups built from one :class:`~llmserve.config.ParallelConfig`.

Rank layout (vLLM's ``parallel_state``: tp is the fastest-varying index)::

    world rank = pp_rank * tp_size + tp_rank        tp=2, pp=1:  ranks 0 1 = one tp group

    tp=2, pp=2:            tp group      pp group
        stage 0: ranks 0 1   {0,1}        {0,2} {1,3}
        stage 1: ranks 2 3   {2,3}

Collectives run over ``torch.distributed`` on the group a :class:`GroupCoordinator`
wraps. On CPU one gloo group carries everything. On CUDA (one process per GPU) each
group is a pair, as vLLM's ``GroupCoordinator`` holds a ``device_group`` and a
``cpu_group``: tensors (all-reduce, all-gather, the pipeline's hidden states) go over
NCCL, and pickled objects (the driver's step broadcast, the sampler's output, block
counts) over a gloo group on the same ranks, so no object round-trips through device
memory. Rank 0 is the *driver*: it runs the scheduler and the sampler; the other ranks
follow the steps it broadcasts.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmserve.config import ParallelConfig


class GroupCoordinator:
    """One process group and this process's place in it.

    Args:
        group: a ``torch.distributed`` backend object (``ProcessGroupGloo`` /
            ``ProcessGroupNCCL``) over exactly these ranks; None: a single-rank group,
            every collective is the identity. No global default group is used, so one
            process may hold several engines' groups.
        ranks: the world ranks of the group, in group-rank order.
        rank: this process's world rank.
        cpu_group: a gloo group over the same ranks for pickled objects and host scalars;
            None: ``group`` itself (gloo, CPU tensors).
    """

    def __init__(self, group, ranks: list[int], rank: int, cpu_group=None) -> None:
        self.group = group
        self.cpu_group = group if cpu_group is None else cpu_group
        self.ranks = list(ranks)
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(rank)
        self.is_first_rank = self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns it. Reduced in float32 whatever
        ``x``'s dtype (gloo has no bfloat16 sum; fp32 also keeps the partial sums of a
        row-parallel matmul from being rounded twice)."""
        if self.world_size == 1:
            return x
        if x.dtype == torch.float32:
            self.group.allreduce([x]).wait()
            return x
        wide = x.float()
        self.group.allreduce([wide]).wait()
        return x.copy_(wide)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``, in
        group-rank order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` over the group (e.g. the KV block count)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.cpu_group.allreduce([t], opts).wait()
        return int(t.item())

    def broadcast_object(self, obj: object = None) -> object:
        """Pickle ``obj`` on the group's first rank and return it on every rank (one
        length broadcast, then the bytes; as ``broadcast_object_list`` does)."""
        if self.world_size == 1:
            return obj
        if self.is_first_rank:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            self.cpu_group.broadcast(torch.tensor([len(payload)], dtype=torch.int64),
                                     0).wait()
            self.cpu_group.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8),
                                     0).wait()
            return obj
        size = torch.empty(1, dtype=torch.int64)
        self.cpu_group.broadcast(size, 0).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.cpu_group.broadcast(data, 0).wait()
        return pickle.loads(data.numpy().tobytes())

    def send(self, x: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Point-to-point send of ``x`` to group rank ``dst`` (blocks until sent)."""
        self.group.send([x.contiguous()], dst, tag).wait()

    def recv(self, x: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receive into ``x`` (its shape and dtype must match the sender's) from group
        rank ``src``; returns ``x``."""
        self.group.recv([x], src, tag).wait()
        return x

    def send_object(self, obj: object, dst: int, tag: int = 0) -> None:
        """Pickle ``obj`` and send it to group rank ``dst`` (a length, then the bytes)."""
        for work, _ in self.isend_object(obj, dst, tag):
            work.wait()

    def isend_object(self, obj: object, dst: int, tag: int = 0) -> list:
        """Start sending ``obj`` to group rank ``dst`` without waiting: ``[(work,
        buffer), ...]``; keep the buffers alive until each ``work.is_completed()``."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(payload)], dtype=torch.int64)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return [(self.cpu_group.send([size], dst, tag), size),
                (self.cpu_group.send([data], dst, tag), data)]

    def recv_object(self, src: int, tag: int = 0) -> object:
        """The object :meth:`send_object` sent from group rank ``src``."""
        size = torch.empty(1, dtype=torch.int64)
        self.cpu_group.recv([size], src, tag).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.cpu_group.recv([data], src, tag).wait()
        return pickle.loads(data.numpy().tobytes())


@dataclass
class ParallelGroups:
    """This process's groups: ``tp`` splits layers, ``pp`` chains stages (this rank and
    its peers of the same tp rank in the other stages), ``world`` every rank of the
    engine (the driver broadcasts each step on it; the tp group itself when pp = 1)."""

    rank: int
    world_size: int
    tp: GroupCoordinator
    pp: GroupCoordinator
    world: GroupCoordinator | None = None

    def __post_init__(self) -> None:
        if self.world is None:
            self.world = self.tp

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (0 = owns the embedding)."""
        return self.pp.rank_in_group

    @property
    def is_last_stage(self) -> bool:
        """The stage that owns the final norm, the LM head and (tp rank 0) the sampler."""
        return self.pp.rank_in_group == self.pp.world_size - 1

    @property
    def is_driver(self) -> bool:
        """World rank 0: runs the scheduler and the sampler."""
        return self.rank == 0

    @classmethod
    def single(cls) -> ParallelGroups:
        """The groups of a single-process engine (no torch.distributed)."""
        return cls(0, 1, GroupCoordinator(None, [0], 0), GroupCoordinator(None, [0], 0))


def backend_for_device(device: str) -> str:
    """The ``torch.distributed`` backend for an engine device: ``"nccl"`` for
    ``cuda[:N]``, ``"gloo"`` for ``cpu``."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def rank_device(device: str, rank: int, device_count: int) -> str:
    """The device world rank ``rank`` runs on: ``cpu`` stays ``cpu``; ``cuda[:N]`` is one
    GPU per rank, ``cuda:(N + rank) % device_count`` of the GPUs this process sees (a
    Ray task sees only its own GPU, so there every rank gets ``cuda:0``).

    Raises:
        ValueError: CUDA requested but ``device_count`` is 0.
    """
    if not str(device).startswith("cuda"):
        return device
    if device_count < 1:
        raise ValueError(f"device {device!r}: this process sees no CUDA device")
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{(base + rank) % device_count}"


def check_devices_for_ranks(device: str, world_size: int, device_count: int) -> None:
    """Start-up check for one machine (``mp`` backend): one GPU per rank.

    Raises:
        ValueError: fewer visible CUDA devices than ranks, naming both counts.
    """
    if str(device).startswith("cuda") and device_count < world_size:
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {world_size} "
                         f"ranks need {world_size} CUDA devices (one per rank); this "
                         f"machine has {device_count}")


def init_parallel_groups(config: ParallelConfig, rank: int, store: dist.Store,
                         backend: str = "gloo",
                         timeout_s: float = 600.0) -> ParallelGroups:
    """Build this rank's tp and pp groups over ``store`` (collective: every rank of the
    world calls it with the same config). Each group is its own backend object over a
    ``PrefixStore`` (``"tp<i>/"``, ``"pp<i>/"``); no default group is created. With
    ``nccl`` each group also gets its gloo ``cpu_group`` (``"tp<i>/cpu/"``, ...) for
    objects; the caller has already chosen this rank's GPU (``torch.cuda.set_device``).

    Args:
        config: the parallel layout; ``world_size = tp x pp``.
        rank: this process's world rank.
        store: a rendezvous store every rank reaches (a ``TCPStore`` on loopback).
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA, one process per device).
        timeout_s: how long a collective may wait for a peer before it raises.

    Raises:
        ValueError: an unknown backend.
    """
    world = config.world_size
    tp_size = config.tensor_parallel_size
    tp_index, pp_index = rank // tp_size, rank % tp_size
    tp_ranks = [tp_index * tp_size + t for t in range(tp_size)]
    pp_ranks = [p * tp_size + pp_index for p in range(world // tp_size)]
    timeout = datetime.timedelta(seconds=timeout_s)

    def coordinator(prefix: str, ranks: list[int]) -> GroupCoordinator:
        group_store = dist.PrefixStore(prefix, store)
        group = _backend(backend, group_store, ranks.index(rank), len(ranks), timeout)
        cpu_group = None
        if backend == "nccl":
            cpu_group = _backend("gloo", dist.PrefixStore("cpu/", group_store),
                                 ranks.index(rank), len(ranks), timeout)
        return GroupCoordinator(group, ranks, rank, cpu_group)

    tp_coord = coordinator(f"tp{tp_index}/", tp_ranks)
    pp_coord = coordinator(f"pp{pp_index}/", pp_ranks)
    world_coord = tp_coord
    if world > tp_size:  # pipeline stages: one more group over every rank, for the steps
        world_coord = coordinator("world/", list(range(world)))
    return ParallelGroups(rank, world, tp_coord, pp_coord, world_coord)


def _backend(backend: str, store: dist.Store, rank: int, size: int,
             timeout: datetime.timedelta):
    """A gloo or NCCL process group over ``size`` ranks (None for one rank)."""
    if size == 1:
        return None
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise ValueError("backend 'nccl' (device cuda): this torch build has no NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"unknown torch.distributed backend {backend!r}; expected gloo or nccl")

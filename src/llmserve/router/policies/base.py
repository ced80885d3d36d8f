"""The routing policy interface and its registry.

A policy picks one worker for a request out of the *eligible* workers the router
passes it (healthy, not draining, breaker closed or half-open, not yet tried for
this request). It is pure logic over :class:`~llmserve.router.worker.Worker`
state, so it is tested without processes. Invariants:

- ``select`` is called with at least one worker and returns one of them.
- ``on_routed`` is called once for the worker that actually got the request
  (after a failover too), so a policy's view follows what was routed.
- ``on_remove`` is called when a worker leaves; the policy forgets it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from llmserve.router.worker import Worker


@dataclass
class RouteRequest:
    """What a policy sees of a request: ``block_hashes`` of the full prompt blocks
    (empty when not tokenized), ``block_size`` tokens each, and ``num_tokens``.

    A request to a LoRA adapter (``lora_name``) is hashed per worker, as that
    worker's prefix cache salts it (its adapter's ``lora_int_id``, from its
    ``/v1/models`` card): :meth:`hashes_for`. ``matched`` (leading blocks each
    worker id is known to hold) and ``sequence`` (a shared round-robin counter) are
    filled from shared state (Redis) before ``select``; None: the policy's own view.
    """

    block_hashes: list[bytes] = field(default_factory=list)
    num_tokens: int = 0
    block_size: int = 16
    token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    lora_name: str | None = None
    matched: dict[str, int] | None = None
    sequence: int | None = None
    _by_lora_id: dict[int, list[bytes]] = field(default_factory=dict, repr=False)

    def hashes_for(self, worker: Worker) -> list[bytes]:
        """The block hashes ``worker``'s prefix cache gives this prompt: with its
        adapter id when the request names a LoRA adapter the worker publishes,
        else ``block_hashes``."""
        lora_id = worker.lora_int_id(self.lora_name) if self.lora_name else None
        if lora_id is None:
            return self.block_hashes
        if lora_id not in self._by_lora_id:
            from llmserve.router.prefix import prompt_block_hashes
            self._by_lora_id[lora_id] = prompt_block_hashes(
                self.token_ids, self.block_size, self.cache_salt, lora_id)
        return self._by_lora_id[lora_id]


@dataclass
class Decision:
    """The chosen worker and why: ``cache_hit``, ``balance``, ``miss``, ``hash``,
    ``load``, ``round_robin`` (the router adds ``session`` and ``failover``).
    ``matched_tokens``: the prompt tokens the policy expects to be cached there."""

    worker: Worker
    reason: str
    matched_tokens: int = 0


class RoutingPolicy(abc.ABC):
    """One routing policy; subclasses register with :func:`register_policy`."""

    name: str = ""
    needs_tokens: bool = False  # True: the router tokenizes prompts for this policy
    wants_sequence: bool = False  # True: shared state fills ``request.sequence``

    @abc.abstractmethod
    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        """Pick one of ``workers`` (non-empty) for ``request``."""

    def on_routed(self, request: RouteRequest, worker: Worker) -> None:  # noqa: B027
        """The request went to ``worker`` (default: nothing to remember)."""

    def on_remove(self, worker_id: str) -> None:  # noqa: B027
        """``worker_id`` left the pool (default: nothing to forget)."""


def least_loaded(workers: list[Worker]) -> Worker:
    """The worker with the fewest router in-flight requests (ties: first by id)."""
    return min(workers, key=lambda w: (w.in_flight, w.id))


_POLICIES: dict[str, type[RoutingPolicy]] = {}


def register_policy(cls: type[RoutingPolicy]) -> type[RoutingPolicy]:
    """Class decorator: make ``cls`` available by ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _POLICIES[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def create_policy(name: str, **options) -> RoutingPolicy:
    """A new instance of the policy registered as ``name``, with its ``options``.

    Raises:
        ValueError: no policy has that name.
    """
    if name not in _POLICIES:
        raise ValueError(f"policy: unknown routing policy {name!r}; "
                         f"choose one of {', '.join(policy_names())}")
    cls = _POLICIES[name]
    import inspect
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in options.items() if k in accepted})

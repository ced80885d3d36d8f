"""Routing policies, one per file, registered by name (see :mod:`.base`)."""

from llmserve.router.policies import cache_aware, least_load, prefix_hash, round_robin  # noqa: F401
from llmserve.router.policies.base import (
    Decision,
    RouteRequest,
    RoutingPolicy,
    create_policy,
    policy_names,
    register_policy,
)

__all__ = ["Decision", "RouteRequest", "RoutingPolicy", "create_policy", "policy_names",
           "register_policy"]

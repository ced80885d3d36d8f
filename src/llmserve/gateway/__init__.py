"""The gateway (``llmserve gateway``): API keys, RBAC, rate limits and quotas shared
through Redis, priority lanes, metrics, audit log and content safety, in front of
OpenAI-compatible upstreams.

Serving plane: this package imports neither torch nor the engine (DESIGN.md section 1).
"""

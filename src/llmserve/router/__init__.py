"""``llmserve router``: a serving-plane process (no torch, no engine import) that
routes OpenAI-compatible requests over N workers.

Parts: :mod:`.worker` (per-worker state, circuit breaker), :mod:`.prefix` (the
engine's block hashes for a prompt), :mod:`.policies` (one routing policy per file,
registered by name), :mod:`.health` (active health checks and ``/metrics`` scrapes),
:mod:`.app` (the FastAPI proxy with retries and SSE passthrough).
"""

"""The engine: LLMEngine (synchronous core) and LLM (offline API)."""

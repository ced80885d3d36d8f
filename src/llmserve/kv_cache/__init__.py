"""llmserve.kv_cache."""

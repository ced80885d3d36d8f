"""llmserve.engine."""

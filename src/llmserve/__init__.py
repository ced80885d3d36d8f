"""llmserve."""

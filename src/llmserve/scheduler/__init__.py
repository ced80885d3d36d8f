"""llmserve.scheduler."""

"""llmserve.worker."""

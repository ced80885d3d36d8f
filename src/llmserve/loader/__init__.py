"""llmserve.loader."""

"""llmserve.entrypoints."""

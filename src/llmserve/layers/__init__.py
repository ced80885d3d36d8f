"""llmserve.layers."""

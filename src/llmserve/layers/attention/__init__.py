"""llmserve.layers.attention."""

"""llmserve.models."""

"""llmserve.planner."""

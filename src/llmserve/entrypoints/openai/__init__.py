"""The OpenAI-compatible HTTP server (``llmserve serve``): pydantic protocol models,
the FastAPI app, completions and chat handlers."""

"""OpenAI's Batch API format, a durable checkpoint, and the runner that feeds a batch
through the engine's continuous batching (``llmserve batch run`` and the server's
``/v1/batches``)."""

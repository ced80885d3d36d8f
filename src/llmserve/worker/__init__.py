"""Model execution on one device: the model runner and the KV cache tensors."""

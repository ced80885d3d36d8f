"""Model registry on S3-compatible storage: content-addressed objects, manifests, tags, a verified local cache. Serving plane: imports neither torch nor the engine."""

"""Deployment as code: the spec (llmserve.yaml), the local launcher, Kubernetes manifests, the autoscaler. Serving plane: imports neither torch nor the engine."""

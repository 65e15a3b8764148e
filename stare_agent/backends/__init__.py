"""Training backends: local (single process) and openrlhf (clusters)."""

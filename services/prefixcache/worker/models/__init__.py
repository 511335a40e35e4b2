"""Model definitions that run over the paged KV cache."""

"""vLLM KV-connector shim and router for kvpush (arrives with its own issue)."""

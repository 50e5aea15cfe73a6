"""NIXL transport adapter for kvpush (arrives with its own issue)."""

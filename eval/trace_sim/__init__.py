"""Trace-driven simulator for prefix-cache eviction policies (see docs/saecache.md)."""

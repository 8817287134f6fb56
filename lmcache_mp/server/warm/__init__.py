"""Warm restart: the pool kept in a named segment, and the signed snapshot of its index."""

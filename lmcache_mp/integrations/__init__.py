"""Connectors that plug lmcache-mp into inference engines; each imports its engine itself."""

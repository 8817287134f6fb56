"""lmcache-mp: a standalone multi-process KV-cache server and its client library."""

__version__ = "0.1.0"

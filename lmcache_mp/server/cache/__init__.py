"""The cache core: chunks and their rules, the store, leases, quotas, eviction, the pools."""

"""The second tier: chunks shared beyond one node through a distributed store (Redis or
Valkey, a Redis Cluster, or a Mooncake Store)."""

"""The second tier: chunks shared beyond one node through a distributed store (Redis)."""

"""The disk tier: chunks kept on a local filesystem under the CPU pool, valid after a crash."""

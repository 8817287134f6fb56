"""What the lower tiers (disk, L2) share: their front, the write queue, the LOOKUP hook,
the landing of pulled chunks, and the names of chunks."""

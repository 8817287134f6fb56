"""What the lower tiers (disk, L2) share: chunk names, the LOOKUP hook and the read-back."""

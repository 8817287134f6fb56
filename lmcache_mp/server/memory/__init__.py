"""Worker memory: registrations, the handles they map, and the kernels that copy their bytes."""

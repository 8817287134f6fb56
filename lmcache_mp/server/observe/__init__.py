"""What the server says of itself: counters, Prometheus, the loop watch, the GC guard, logs."""

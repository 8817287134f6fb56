"""The harness every workload runs on: a spawned server (server.py), simulated engines and
their rank processes (engine.py, ranks.py) stepped through phases (steps.py), the bounds
measured beside them (bounds.py, disk_bound.py, the Redis peer in redis_peer.py), the L2
stores a --nodes run starts (redis_peer.py, l2_stores.py), the arithmetic (stats.py), and
the report (report.py; output.py prints it, plot.py draws it)."""

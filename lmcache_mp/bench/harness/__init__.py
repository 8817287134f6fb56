"""The harness every workload runs on: a spawned server (server.py), simulated engines and
their rank processes (engine.py, ranks.py) stepped through phases (steps.py), the bounds
measured beside them (bounds.py, disk_bound.py, the Redis peer in redis_peer.py), the
arithmetic (stats.py), and the report (report.py; output.py prints it, plot.py draws it)."""

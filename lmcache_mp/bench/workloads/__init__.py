"""The workloads `lmcache-mp-bench --workload` runs, one module each, on the harness.

Simulated engines (simulated.py runs them): uniform.py (W1, W2, W3), chat.py (and
disk_chat.py for `chat --disk-size`, nodes.py for `chat --nodes`) and multi_tenant.py. On
servers of their own: engine.py (real vLLM engines), warm_restart.py, disk.py (with
disk_restart.py), trace.py (a request trace replayed: trace_file.py reads it,
trace_bound.py computes what any cache could hit on it, trace_report.py reports),
sglang.py (SGLang's HiCache storage path through our backend and its own file backend;
sglang_report.py reports).
main.py picks the one `--workload` names.
"""

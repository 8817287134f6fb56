"""`--workload`: the module that runs it, for resolved options; its exit status."""

from __future__ import annotations

from ..options import BenchOptions
from . import disk, disk_chat, engine, nodes, sglang, simulated, trace, warm_restart


def main(options: BenchOptions) -> int:
    if options.workload == "engine":
        return engine.main(options)
    if options.workload == "warm-restart":
        return warm_restart.main(options)
    if options.workload == "disk":
        return disk.main(options)
    if options.workload == "trace":
        return trace.main(options)
    if options.workload == "sglang":
        return sglang.main(options)
    if options.nodes > 1:
        return nodes.main(options)
    if options.disk_size is not None:
        return disk_chat.main(options)
    return simulated.main(options)

"""The --plot PNG: throughput per step, LOOKUP latency against the echo, and the headline bars."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .report import Report


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def draw(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ((steps_ax, bars_ax), (latency_ax, hist_ax)) = plt.subplots(2, 2, figsize=(13, 9))
    fig.suptitle(f"lmcache-mp-bench --workload {report.meta['options']['workload']}"
                 f" ({report.meta['shape']})", fontsize=10)
    _steps(steps_ax, report)
    _bars(bars_ax, report)
    _latency(latency_ax, hist_ax, report)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _steps(steps_ax: Any, report: Report) -> None:
    """Throughput per step, each phase after the one before."""
    offset = 0.0
    for phase in report.phases:
        for label, attr, style in (("STORE", "store_gbps", "o-"),
                                   ("RETRIEVE", "retrieve_gbps", "s-"),
                                   ("Redis SET", "peer_store_gbps", "o:"),
                                   ("Redis GET", "peer_retrieve_gbps", "s:")):
            points = [(offset + s.at_s, getattr(s, attr)) for s in phase.steps
                      if not math.isnan(getattr(s, attr))]
            if points:
                xs, ys = zip(*points)
                name = label if len(report.phases) == 1 else f"{phase.name}: {label}"
                steps_ax.plot(xs, ys, style, markersize=3, label=name)
        offset += phase.seconds
    steps_ax.axhline(report.copy_bound_gbps, color="grey", linestyle="--",
                     label="1-thread copy bound")
    steps_ax.set(title="Throughput per step", xlabel="seconds into the run", ylabel="GB/s")
    steps_ax.legend(fontsize=7)


def _bars(bars_ax: Any, report: Report) -> None:
    """Bandwidth over the run beside the copy bound (and Redis)."""
    f = report.figures
    names = ["copy bound", "STORE", "RETRIEVE"]
    values = [report.copy_bound_gbps, f.store.measured, f.retrieve.measured]
    if f.store_vs_redis is not None and f.retrieve_vs_redis is not None:
        names += ["Redis SET", "Redis GET"]
        values += [f.store_vs_redis.bound, f.retrieve_vs_redis.bound]
    bars_ax.bar(names, [0 if math.isnan(v) else v for v in values],
                color=["grey", "tab:blue", "tab:orange", "tab:red", "tab:purple"][:len(names)])
    bars_ax.set(title="Bandwidth over the run", ylabel="GB/s")


def _latency(latency_ax: Any, hist_ax: Any, report: Report) -> None:
    """LOOKUP round trips against the echo's: their CDF and a log-spaced histogram."""
    for label, samples in (("LOOKUP", report.lookup_samples_us),
                           ("raw pyzmq echo", report.echo_samples_us)):
        ordered = sorted(_finite(samples))
        if ordered:
            latency_ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))],
                            label=label)
    latency_ax.set(title="Round-trip latency (CDF)", xlabel="µs", ylabel="fraction",
                   xscale="log")
    latency_ax.legend(fontsize=8)

    everything = _finite(report.lookup_samples_us + report.echo_samples_us)
    if everything:
        low, high = max(min(everything), 1.0), max(everything)
        edges = [low * (high / low) ** (i / 60) for i in range(61)]  # log-spaced: long tails
        for label, samples in (("LOOKUP", report.lookup_samples_us),
                               ("raw pyzmq echo", report.echo_samples_us)):
            hist_ax.hist(_finite(samples), bins=edges, alpha=0.6, label=label)
        hist_ax.legend(fontsize=8)
    hist_ax.set(title="Round-trip latency (histogram)", xlabel="µs", ylabel="round trips",
                xscale="log", yscale="log")

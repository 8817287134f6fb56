"""`--plot` of `--workload trace`: hit rate against the pool's size, each eviction policy
modelled on the same requests (trace_sim.py), beside the unbounded cache and the optimal
bound, and the replay's own figure marked."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import trace_bound, trace_sim
from .trace_file import TraceRequest

SHARES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)  # pool sizes, as shares of the distinct blocks


@dataclass(frozen=True)
class Curves:
    """Hit rates in blocks at each share of the distinct blocks."""

    shares: tuple[float, ...]
    by_policy: dict[str, list[float]]  # each trace_sim.EVICTIONS policy, the pool alone
    bound: list[float]  # the optimal bound at each capacity
    unbounded: float


def curves(requests: Sequence[TraceRequest], chunks: Callable[[float], int],
           shares: tuple[float, ...] = SHARES) -> Curves:
    """The figures at each share; `chunks(share)`: the pool's capacity in chunks, as the
    replay sizes it."""
    blocks = sum(len(request.hash_ids) for request in requests)
    by_policy = {policy: [trace_sim.simulate(requests, chunks(share), eviction=policy).hits
                          / blocks for share in shares]
                 for policy in trace_sim.EVICTIONS}
    bound = [trace_bound.belady(requests, chunks(share)).residency / blocks
             for share in shares]
    return Curves(shares, by_policy, bound, trace_bound.unbounded(requests).prefix / blocks)


def draw(figures: Curves, measured: tuple[float, float, str], title: str, path: Path) -> None:
    """The curves to a PNG at `path`; `measured`: the replay's (share, hit rate, policy)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(figsize=(8, 5.5))
    percent = [100 * share for share in figures.shares]
    for policy, rates in figures.by_policy.items():
        axes.plot(percent, [100 * rate for rate in rates], "o-", markersize=4,
                  label=f"{policy} (modelled)")
    axes.plot(percent, [100 * rate for rate in figures.bound], "k--",
              label="optimal bound (Belady)")
    axes.axhline(100 * figures.unbounded, color="grey", linestyle=":", label="unbounded")
    share, rate, policy = measured
    axes.plot([100 * share], [100 * rate], "r*", markersize=12,
              label=f"this replay's server ({policy})")
    axes.set(title=title, xlabel="pool, % of the trace's distinct blocks",
             ylabel="hit rate, % of blocks", xscale="log")
    axes.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""Child processes that start in a fraction of a second: forked from a forkserver that
imported the heavy modules (torch, the client) once, where a spawned child spends seconds
importing them again.

The forkserver is exec'd clean (never forked from the caller and its threads), runs no torch
op and never touches CUDA, so a child forked from it is as fresh as a spawned one, CUDA
included. There is one forkserver per process: the first preload list given before it
starts is the one it imports; a child needing other modules still imports them itself.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence


def preloaded_context(modules: Sequence[str]) -> multiprocessing.context.ForkServerContext:
    """A multiprocessing context whose processes fork from a forkserver that imported
    `modules` (each child's target module among them, for the whole gain)."""
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(list(modules))
    return forkserver

"""The device layer under GPU copies: streams, events and their completion, behind one interface.

CudaDevice runs on torch.cuda. The copy code (server/copy/streams.py) only ever talks to a
Device, so tests drive the same state machine on the CPU with a fake whose events
complete when the test says so.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch

from ... import cuda


class Device(Protocol):
    def new_stream(self, device: torch.device) -> Any:
        """A stream of its own on `device`."""

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        """Within it, torch work on the stream's device is queued on `stream`."""

    def record(self, stream: Any) -> Any:
        """An event that completes when the work queued on `stream` so far has finished."""

    def wait(self, stream: Any, event: Any) -> None:
        """Work queued on `stream` from now on starts after `event` completes (no host wait)."""

    def query(self, event: Any) -> bool:
        """Whether `event` has completed; never blocks."""

    def used_on(self, tensor: torch.Tensor, stream: Any) -> None:
        """`tensor`, allocated on another stream, is used by work queued on `stream`: its
        memory must not be reused before that work has finished."""

    def open_event(self, device: torch.device, handle: bytes) -> Any:
        """Another process's interprocess event, from its cudaIpcEventHandle_t."""


class CudaDevice:
    """The Device of a process with CUDA: torch streams and events."""

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        # Not torch.cuda.Stream(): that hands out torch's 32 pooled streams per GPU in turn,
        # so past 16 registrations on a GPU two lanes would share a stream and each wait
        # for the other's copies.
        index = device.index
        return cuda.new_stream(torch.cuda.current_device() if index is None else index)

    def use(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def query(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def used_on(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)

    def open_event(self, device: torch.device, handle: bytes) -> torch.cuda.Event:
        return torch.cuda.Event.from_ipc_handle(device, handle)

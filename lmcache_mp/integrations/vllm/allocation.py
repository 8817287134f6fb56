"""On CPU, vLLM's KV cache allocated in sealed memfds the server can map."""

from __future__ import annotations

import logging
import os
import uuid

import torch

from ...client.memfd import SEGMENT_PREFIX, SharedSegment

logger = logging.getLogger(__name__)


class SharedMemoryAllocation(torch.overrides.TorchFunctionMode):
    """Within it, torch.zeros on the CPU allocates in a new SharedSegment (a memfd sealed
    against shrinking, zeroed as new memfds are) and records it in `segments`. The tensor
    keeps the segment's mapping alive; closing the segment (shutdown) closes its descriptor,
    and the memory goes with the last tensor over it. Nothing is left in any file system if
    the process dies."""

    def __init__(self, segments: list[SharedSegment]):
        super().__init__()
        self.segments = segments

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and torch.device(kwargs.get("device") or "cpu").type == "cpu" \
                and not kwargs.get("requires_grad") and kwargs.get("out") is None:
            meta = torch.zeros(*args, **{**kwargs, "device": "meta"})
            nbytes = meta.numel() * meta.element_size()
            if nbytes > 0:
                segment = SharedSegment(
                    nbytes, name=f"{SEGMENT_PREFIX}vllm_{os.getpid()}_{uuid.uuid4().hex[:12]}")
                self.segments.append(segment)
                logger.info("KV cache of %d bytes in memfd %s", nbytes, segment.name)
                # tensor() keeps the mapping alive while vLLM's tensors use it.
                return segment.tensor(torch.uint8).view(meta.dtype).view(meta.shape)
        return func(*args, **kwargs)

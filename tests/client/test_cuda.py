"""cuda_ipc handles on the client: allocation grouping, offsets and UUIDs, without a GPU."""

import pytest
import torch

from lmcache_mp.client.cuda import (
    Allocation,
    Placement,
    allocator_settings,
    cuda_ipc_handles,
    export_refusal,
    place_tensors,
)
from lmcache_mp.cuda import normalize_uuid
from lmcache_mp.protocol import span_bytes

MIB = 1024**2


def fake_allocations(table):
    """find_allocation over a {device: [(base, size), ...]} table, counting its calls."""
    calls = []

    def find(device, address):
        calls.append((device, address))
        for base, size in table[device]:
            if base <= address < base + size:
                return base, size
        raise AssertionError(f"no allocation holds {address:#x}")
    return find, calls


def test_tensors_are_grouped_by_allocation_with_their_offsets():
    find, calls = fake_allocations({0: [(0x10000000, 64 * MIB), (0x20000000, 8 * MIB)],
                                    1: [(0x10000000, 64 * MIB)]})
    extents = [
        (0, 0x10000000 + 2 * MIB, 2 * MIB),  # inside the first allocation, not at its start
        (0, 0x10000000 + 4 * MIB, 2 * MIB),  # the same allocation: no second lookup
        (0, 0x20000000, 8 * MIB),  # exactly fills the second one
        (1, 0x10000000 + 512, 4096),  # the same addresses on another device are another one
    ]
    allocations, placements = place_tensors(extents, find)
    assert allocations == [Allocation(0, 0x10000000, 64 * MIB), Allocation(0, 0x20000000, 8 * MIB),
                           Allocation(1, 0x10000000, 64 * MIB)]
    assert placements == [Placement(0, 2 * MIB), Placement(0, 4 * MIB), Placement(1, 0),
                          Placement(2, 512)]
    assert len(calls) == 3


def test_a_tensor_that_overruns_its_allocation_is_named():
    find, _ = fake_allocations({0: [(0x1000, 4096)]})
    with pytest.raises(ValueError, match=r"tensor 1 spans bytes \[0x1800, 0x2800\), beyond its "
                                         r"CUDA allocation \[0x1000, 0x2000\) on device 0"):
        place_tensors([(0, 0x1000, 16), (0, 0x1800, 4096)], find)


def test_span_follows_shape_and_strides():
    # A vLLM MHA layer [blocks, heads, block_size, 2*head_dim] seen as [2, blocks, block_size,
    # heads, head_dim]: the same bytes, whatever the view.
    layer = torch.empty(10, 4, 16, 256, dtype=torch.float16)
    assert span_bytes(list(layer.shape), list(layer.stride()), 2) == layer.numel() * 2
    half = layer[..., :128]
    assert span_bytes(list(half.shape), list(half.stride()), 2) == (layer.numel() - 128) * 2


def test_cpu_tensors_are_refused_before_any_cuda_call():
    with pytest.raises(ValueError, match="tensor 0 is on cpu, not on a CUDA device"):
        cuda_ipc_handles([torch.zeros(4)])


def test_uuids_are_normalized():
    torch_form = "58b8f8a1-0c3d-4e5f-8a9b-0123456789ab"
    assert normalize_uuid("GPU-58B8F8A1-0C3D-4E5F-8A9B-0123456789AB") == torch_form
    assert normalize_uuid(torch_form) == torch_form
    assert normalize_uuid(torch_form.replace("-", "")) == torch_form
    with pytest.raises(ValueError, match="not a GPU UUID"):
        normalize_uuid("GPU-0")


def test_allocator_settings_are_read_from_either_variable_case_blind():
    assert allocator_settings({}) == {}
    assert allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True, "
                                                          "max_split_size_mb:128"}) == {
        "expandable_segments": "true", "max_split_size_mb": "128"}
    assert allocator_settings({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}) == {
        "backend": "cudamallocasync"}
    assert allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "backend:native",
                               "PYTORCH_ALLOC_CONF": "expandable_segments:true"}) == {
        "backend": "native", "expandable_segments": "true"}


@pytest.mark.parametrize("conf, words", [
    ("expandable_segments:True", "start the worker without it (unset it, or set "
                                 "expandable_segments:False)"),
    ("backend:cudaMallocAsync", "sets backend:cudaMallocAsync"),
    ("", "--enable-sleep-mode"),
    ("expandable_segments:False", "--enable-sleep-mode"),  # off: not the cause
])
def test_memory_cuda_ipc_cannot_share_is_refused_with_what_to_change(conf, words):
    settings = allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": conf})
    refusal = export_refusal(3, False, settings)
    assert refusal is not None
    assert refusal.startswith("tensor 3 lies in GPU memory that CUDA IPC cannot share")
    assert words in refusal


def test_cudamalloc_memory_passes_whatever_the_settings():
    for conf in ("", "expandable_segments:True", "backend:cudaMallocAsync"):
        assert export_refusal(0, True, allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": conf})
                              ) is None

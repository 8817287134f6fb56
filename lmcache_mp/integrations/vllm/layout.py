"""vLLM's KV cache tensors, seen as the server's MHA, MLA and state layouts (views of the same
bytes)."""

from __future__ import annotations

from dataclasses import replace

from ...protocol import TensorHandle


def as_server_layout(handle: TensorHandle, layout: str, block_size: int) -> TensorHandle:
    """A vLLM KV cache tensor as the server's layout, by shape and strides alone.

    vLLM 0.33 hands each layer on the CPU as [blocks, heads, block_size, C] in any stride
    order, with C = K and V together (MHA) or the latent vector (MLA, one head); on a GPU
    as [2, blocks, block_size, heads, head_dim] (FlashAttention), [blocks, 2, block_size,
    heads, head_dim] (FlashInfer, Triton) or [blocks, block_size, C] (MLA), again in any
    stride order. The server takes MHA as [2, blocks, block_size, heads, head_dim] and MLA
    as [blocks, block_size, C]: a view of the same bytes. Which half of C is K does not
    matter, as whole blocks move byte for byte.
    """
    shape, strides = handle.shape, handle.strides
    if layout == "state":
        return _as_state(handle)
    if layout == "mha" and len(shape) == 5 and shape[0] == 2:
        new_shape, new_strides = shape, strides
    elif layout == "mha" and len(shape) == 5 and shape[1] == 2:
        new_shape = [2, shape[0], *shape[2:]]
        new_strides = [strides[1], strides[0], *strides[2:]]
    elif layout == "mla" and len(shape) == 3:
        new_shape, new_strides = shape, strides
    elif len(shape) == 4 and layout == "mha" and shape[3] % 2 == 0:
        blocks, heads, tokens, content = shape
        s_block, s_head, s_token, s_content = strides
        half = content // 2
        new_shape = [2, blocks, tokens, heads, half]
        new_strides = [half * s_content, s_block, s_token, s_head, s_content]
    elif len(shape) == 4 and layout == "mla" and shape[1] == 1:
        new_shape, new_strides = [shape[0], *shape[2:]], [strides[0], *strides[2:]]
    else:
        known = ("[blocks, 1, block_size, dim] (vLLM) or [blocks, block_size, dim]"
                 if layout == "mla" else
                 "[blocks, heads, block_size, K and V] (vLLM), "
                 "[blocks, 2, block_size, heads, head_dim] (vLLM) or "
                 "[2, blocks, block_size, heads, head_dim]")
        raise ValueError(f"a KV cache layer of shape {shape} fits none of the "
                         f"{layout.upper()} shapes lmcache-mp knows: {known}")
    token_dim = 1 if layout == "mla" else 2
    if new_shape[token_dim] != block_size:
        raise ValueError(f"a KV cache layer holds blocks of {new_shape[token_dim]} tokens, but "
                         f"vLLM's block_size is {block_size} (vLLM split its blocks into kernel "
                         f"blocks: use --block-size {new_shape[token_dim]})")
    return replace(handle, shape=list(new_shape), strides=list(new_strides))


def _as_state(handle: TensorHandle) -> TensorHandle:
    """A recurrent layer's states as the server's "state" layout, [blocks, state bytes]:
    vLLM 0.33 hands each such layer as the bytes of its state in every block, [blocks, 1,
    1, state bytes] (int8; the model splits them into its conv and SSM states itself)."""
    shape, strides = handle.shape, handle.strides
    if len(shape) == 4 and shape[1] == shape[2] == 1:
        return replace(handle, shape=[shape[0], shape[3]], strides=[strides[0], strides[3]])
    if len(shape) == 2:
        return handle
    raise ValueError(f"a recurrent state layer of shape {shape} fits none of the shapes "
                     f"lmcache-mp knows: [blocks, 1, 1, state bytes] (vLLM) or "
                     f"[blocks, state bytes]")

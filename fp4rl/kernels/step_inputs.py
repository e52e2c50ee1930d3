"""A decode step's inputs in one launch.

Before each CUDA-graph replay the decode engine writes what the step reads into its static buffers: the
rows' tokens and RoPE positions, the first real slot of each row (slots - the row's real tokens, from the
sampler's mask), every row's length and the slot written. In torch that is seven launches (two copies, the
mask's sum, a subtraction, a cast, two fills), each ~1.5-2 us of a batch-1 step on the GPU, outside the graph
and in series with it; here it is one program per static row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # mask columns a program sums at a time


@triton.jit(do_not_specialize=["slots", "b"])  # (a 1 would become a constant: one kernel for every step)
def _step_inputs_kernel(tok_ptr, tok_stride, pos_ptr, pos_stride, mask_ptr, mask_stride, slots, b,
                        tokens_ptr, positions_ptr, starts_ptr, lengths_ptr, slot_ptr, BLOCK: tl.constexpr):
    r = tl.program_id(0)  # one program per static row: every row's length is the step's slots
    tl.store(lengths_ptr + r, slots)
    if r == 0:
        tl.store(slot_ptr, (slots - 1).to(tl.int64))
    if r < b:
        tl.store(tokens_ptr + r, tl.load(tok_ptr + r * tok_stride).to(tl.int64))
        tl.store(positions_ptr + r, tl.load(pos_ptr + r * pos_stride).to(tl.int64))
        row = mask_ptr + r.to(tl.int64) * mask_stride
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for s in range(0, slots, BLOCK):
            cols = s + tl.arange(0, BLOCK)
            acc += (tl.load(row + cols, mask=cols < slots, other=0) != 0).to(tl.int32)
        tl.store(starts_ptr + r, slots - tl.sum(acc, axis=0))


def write(tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, out_tokens: torch.Tensor,
          out_positions: torch.Tensor, out_starts: torch.Tensor, out_lengths: torch.Tensor,
          out_slot: torch.Tensor) -> None:
    """out_tokens[:b] = tokens, out_positions[:b] = positions, out_starts[:b] = slots - (mask != 0).sum(-1),
    out_lengths[:] = slots, out_slot[0] = slots - 1 for b = tokens.numel() rows and mask [b, slots] (any
    integer or bool dtype, unit column stride): what the torch ops of ``reference`` write, in one launch.
    out_tokens / out_positions / out_slot int64, out_starts / out_lengths int32, all contiguous on mask's
    device, with at least b rows."""
    b, slots = mask.shape
    if tokens.numel() != b or positions.numel() != b:
        raise ValueError(f"step_inputs: {tokens.numel()} tokens and {positions.numel()} positions for a mask "
                         f"of {b} rows; pass one token and one position per mask row")
    if mask.stride(1) != 1 and slots > 1:
        raise ValueError(f"step_inputs: the mask needs unit column stride, got strides {mask.stride()}")
    for name, t in (("tokens", tokens), ("positions", positions)):
        if t.device != mask.device:
            raise ValueError(f"step_inputs: {name} on {t.device}, the mask on {mask.device}; pass both on "
                             "the engine's device")
    outs = (("out_tokens", out_tokens, torch.int64, b), ("out_positions", out_positions, torch.int64, b),
            ("out_starts", out_starts, torch.int32, b), ("out_lengths", out_lengths, torch.int32, b),
            ("out_slot", out_slot, torch.int64, 1))
    for name, t, dtype, need in outs:
        if t.dtype != dtype or not t.is_contiguous() or t.device != mask.device:
            raise ValueError(f"step_inputs: {name} must be contiguous {dtype} on {mask.device}, got "
                             f"{t.dtype} on {t.device}")
        if t.numel() < need:
            raise ValueError(f"step_inputs: {name} holds {t.numel()} rows, this step needs {need}; grow the "
                             "engine's static buffers (new_cache) first")
    m = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    tok, pos = tokens.reshape(-1), positions.reshape(-1)  # (views where they can be: any stride)
    grid = (out_lengths.numel(),)
    _step_inputs_kernel[grid](tok, tok.stride(0), pos, pos.stride(0), m, m.stride(0), slots, b,
                              out_tokens, out_positions, out_starts, out_lengths, out_slot, BLOCK=BLOCK)


def reference(tokens, positions, mask, out_tokens, out_positions, out_starts, out_lengths, out_slot) -> None:
    """``write`` in torch ops (seven launches): the engine's path where the kernels do not run."""
    b, slots = mask.shape
    out_tokens[:b].copy_(tokens.reshape(-1))
    out_positions[:b].copy_(positions.reshape(-1))
    out_starts[:b].copy_(slots - (mask != 0).sum(-1))
    out_lengths.fill_(slots)
    out_slot.fill_(slots - 1)

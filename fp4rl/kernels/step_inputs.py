"""A decode step's inputs in one launch, and its routing record in one.

Before each CUDA-graph replay the decode engine writes what the step reads into its static buffers: the
rows' tokens and RoPE positions, the first real slot of each row (slots - the row's real tokens, from the
sampler's mask), every row's length, the slot written and the sampler's row of each batch row (where the
step records the experts it chose). In torch that is seven launches (two copies, the mask's sum, a
subtraction, a cast, two fills), each ~1.5-2 us of a batch-1 step on the GPU, outside the graph and in series
with it; here it is one program per static row, which also does the sampler's own per-step ops: the mask's
new column set to 1 and the positions advanced by one in place (two more launches).

`record` writes the step's experts into the sampler's routing record, routing[l, rows[i], positions[i]] =
chosen[l, i, 0], in one launch after the step, where rows[i] = -1 marks a bucket's padding rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # mask columns a program sums at a time


@triton.jit(do_not_specialize=["slots", "b"])  # (a 1 would become a constant: one kernel for every step)
def _step_inputs_kernel(tok_ptr, tok_stride, pos_ptr, pos_stride, mask_ptr, mask_stride, rows_ptr,
                        rows_stride, slots, b, tokens_ptr, positions_ptr, starts_ptr, lengths_ptr, slot_ptr,
                        out_rows_ptr, HAS_ROWS: tl.constexpr, ADVANCE: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)  # one program per static row: every row's length is the step's slots
    tl.store(lengths_ptr + r, slots)
    if r == 0:
        tl.store(slot_ptr, (slots - 1).to(tl.int64))
    if r < b:
        tl.store(tokens_ptr + r, tl.load(tok_ptr + r * tok_stride).to(tl.int64))
        pos = tl.load(pos_ptr + r * pos_stride)
        tl.store(positions_ptr + r, pos.to(tl.int64))
        if ADVANCE:
            tl.store(pos_ptr + r * pos_stride, pos + 1)
        if HAS_ROWS:
            tl.store(out_rows_ptr + r, tl.load(rows_ptr + r * rows_stride).to(tl.int64))
        else:
            tl.store(out_rows_ptr + r, tl.full([], -1, tl.int64))
        row = mask_ptr + r.to(tl.int64) * mask_stride
        tl.store(row + slots - 1, 1)  # the new token's slot (counted as 1 below, not read back)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for s in range(0, slots - 1, BLOCK):
            cols = s + tl.arange(0, BLOCK)
            acc += (tl.load(row + cols, mask=cols < slots - 1, other=0) != 0).to(tl.int32)
        tl.store(starts_ptr + r, slots - 1 - tl.sum(acc, axis=0))
    else:
        tl.store(out_rows_ptr + r, tl.full([], -1, tl.int64))  # a padding row of the bucket records nothing


def write(tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, out_tokens: torch.Tensor,
          out_positions: torch.Tensor, out_starts: torch.Tensor, out_lengths: torch.Tensor,
          out_slot: torch.Tensor, out_rows: torch.Tensor, rows: torch.Tensor | None = None,
          advance: bool = False) -> None:
    """For b = tokens.numel() rows and mask [b, slots] (any integer or bool dtype, unit column stride), in
    one launch, what the torch ops of ``reference`` write: mask[:, -1] = 1 (the new token's slot);
    out_tokens[:b] = tokens, out_positions[:b] = positions, out_starts[:b] = slots - (mask != 0).sum(-1),
    out_lengths[:] = slots, out_slot[0] = slots - 1, out_rows[:b] = rows (-1 without rows) and out_rows[b:]
    = -1; then, with advance, positions += 1 in place. out_tokens / out_positions / out_slot / out_rows int64,
    out_starts / out_lengths int32, all contiguous on mask's device, with at least b rows (out_rows as many
    as out_lengths)."""
    b, slots = mask.shape
    if tokens.numel() != b or positions.numel() != b or (rows is not None and rows.numel() != b):
        got = "" if rows is None else f" and {rows.numel()} rows"
        raise ValueError(f"step_inputs: {tokens.numel()} tokens, {positions.numel()} positions{got} for a "
                         f"mask of {b} rows; pass one of each per mask row")
    if slots < 1:
        raise ValueError("step_inputs: the mask has no column; it covers the slots up to the new token's")
    if mask.stride(1) != 1 and slots > 1:
        raise ValueError(f"step_inputs: the mask needs unit column stride, got strides {mask.stride()}")
    named = (("tokens", tokens), ("positions", positions)) + ((("rows", rows),) if rows is not None else ())
    for name, t in named:
        if t.device != mask.device:
            raise ValueError(f"step_inputs: {name} on {t.device}, the mask on {mask.device}; pass both on "
                             "the engine's device")
    if advance and positions.dtype.is_floating_point:
        raise ValueError(f"step_inputs: positions must be integers to advance in place, got "
                         f"{positions.dtype}")
    outs = (("out_tokens", out_tokens, torch.int64, b), ("out_positions", out_positions, torch.int64, b),
            ("out_starts", out_starts, torch.int32, b), ("out_lengths", out_lengths, torch.int32, b),
            ("out_slot", out_slot, torch.int64, 1), ("out_rows", out_rows, torch.int64, out_lengths.numel()))
    for name, t, dtype, need in outs:
        if t.dtype != dtype or not t.is_contiguous() or t.device != mask.device:
            raise ValueError(f"step_inputs: {name} must be contiguous {dtype} on {mask.device}, got "
                             f"{t.dtype} on {t.device}")
        if t.numel() < need:
            raise ValueError(f"step_inputs: {name} holds {t.numel()} rows, this step needs {need}; grow the "
                             "engine's static buffers (new_cache) first")
    m = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    tok, pos = tokens.reshape(-1), positions.reshape(-1)  # (views where they can be: any stride)
    if advance and pos.data_ptr() != positions.data_ptr():
        raise ValueError("step_inputs: advance needs positions that are one view of their storage")
    rr = out_rows if rows is None else rows.reshape(-1)
    grid = (out_lengths.numel(),)
    _step_inputs_kernel[grid](tok, tok.stride(0), pos, pos.stride(0), m, m.stride(0), rr, rr.stride(0), slots,
                              b, out_tokens, out_positions, out_starts, out_lengths, out_slot, out_rows,
                              HAS_ROWS=rows is not None, ADVANCE=bool(advance), BLOCK=BLOCK)


def reference(tokens, positions, mask, out_tokens, out_positions, out_starts, out_lengths, out_slot, out_rows,
              rows=None, advance=False) -> None:
    """``write`` in torch ops: the engine's path where the kernels do not run."""
    b, slots = mask.shape
    mask[:, -1] = 1
    out_tokens[:b].copy_(tokens.reshape(-1))
    out_positions[:b].copy_(positions.reshape(-1))
    out_starts[:b].copy_(slots - (mask != 0).sum(-1))
    out_lengths.fill_(slots)
    out_slot.fill_(slots - 1)
    out_rows.fill_(-1)
    if rows is not None:
        out_rows[:b].copy_(rows.reshape(-1))
    if advance:
        positions.add_(1)


@triton.jit
def _record_kernel(chosen_ptr, c_layer, c_row, rows_ptr, pos_ptr, out_ptr, o_layer, o_row, o_pos, L, K,
                   n_rows, n_pos, LP: tl.constexpr, KP: tl.constexpr):
    i = tl.program_id(0)  # one program per batch row of the step
    row = tl.load(rows_ptr + i)
    pos = tl.load(pos_ptr + i)
    if (row >= 0) & (row < n_rows) & (pos >= 0) & (pos < n_pos):  # -1: a bucket's padding row
        ll = tl.arange(0, LP)[:, None].to(tl.int64)  # (layer offsets past 2^31 elements)
        kk = tl.arange(0, KP)[None, :]
        m = (ll < L) & (kk < K)
        got = tl.load(chosen_ptr + ll * c_layer + i * c_row + kk, mask=m)
        tl.store(out_ptr + ll * o_layer + row * o_row + pos * o_pos + kk, got, mask=m)


def record(chosen: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, out: torch.Tensor) -> None:
    """out[l, rows[i], positions[i], :] = chosen[l, i, 0, :] for every batch row i whose rows[i] >= 0, in one
    launch (the step's routing record). chosen [L, bb, 1, k] contiguous; rows / positions
    int64 [bb] (rows -1: no record); out [L, R, T, k] of chosen's dtype, unit stride in k. A row or position
    outside out's R rows / T slots records nothing (the engine's buffers cover its cache's)."""
    L, bb, _, k = chosen.shape
    if out.ndim != 4 or out.shape[0] != L or out.shape[3] != k or out.dtype != chosen.dtype \
            or out.stride(3) != 1 or out.device != chosen.device:
        raise ValueError(f"step_inputs.record: out must be [{L}, rows, slots, {k}] {chosen.dtype} on "
                         f"{chosen.device} with unit stride in k, got {tuple(out.shape)} {out.dtype} on "
                         f"{out.device}, strides {out.stride()}")
    if not chosen.is_contiguous() or rows.numel() < bb or positions.numel() < bb:
        raise ValueError(f"step_inputs.record: chosen must be contiguous with a row and a position for each "
                         f"of its {bb} rows, got {rows.numel()} rows, {positions.numel()} positions")
    if bb == 0 or L == 0:
        return
    _record_kernel[(bb,)](chosen, chosen.stride(0), chosen.stride(1), rows, positions, out, out.stride(0),
                          out.stride(1), out.stride(2), L, k, out.shape[1], out.shape[2],
                          LP=triton.next_power_of_2(L), KP=triton.next_power_of_2(k))


def record_reference(chosen, rows, positions, out) -> None:
    """``record`` in torch ops (a host sync for the rows that record)."""
    bb = chosen.shape[1]
    rows, positions = rows[:bb], positions[:bb]
    ok = (rows >= 0) & (rows < out.shape[1]) & (positions >= 0) & (positions < out.shape[2])
    keep = ok.nonzero()[:, 0]
    out[:, rows[keep], positions[keep]] = chosen[:, keep, 0]

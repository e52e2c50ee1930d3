"""fp4rl.kernels.step_inputs: a decode step's inputs in one launch and its routing record (TRITON_INTERPRET=1
on CPU), equal to the torch ops they replace, and their refusals."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from fp4rl.kernels import step_inputs  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _buffers(cap):
    return (torch.full((cap,), -7, dtype=torch.long, device=DEV), torch.full((cap,), -7, dtype=torch.long,
            device=DEV), torch.full((cap,), -7, dtype=torch.int32, device=DEV),
            torch.full((cap,), -7, dtype=torch.int32, device=DEV), torch.full((1,), -7, dtype=torch.long,
            device=DEV), torch.full((cap,), -7, dtype=torch.long, device=DEV))


@pytest.mark.parametrize("b,cap,slots,total,dtype,with_rows,advance", [
    (1, 1, 5, 5, torch.long, False, False), (1, 2, 1, 1, torch.long, True, True),
    (3, 4, 1500, 2100, torch.long, True, True), (2, 8, 40, 64, torch.bool, False, True),
    (4, 4, 1024, 1024, torch.int32, True, False), (3, 4, 1025, 1030, torch.long, False, True)])
def test_one_launch_writes_what_the_torch_ops_write(b, cap, slots, total, dtype, with_rows, advance):
    g = torch.Generator().manual_seed(slots)
    full = torch.zeros(b, total, dtype=torch.long)
    for r in range(b):  # left padding of a random length, then real tokens up to the step's slot (unset)
        full[r, torch.randint(0, slots, (1,), generator=g).item():slots - 1] = 1
    full[:, slots - 1] = torch.randint(0, 2, (b,), generator=g)  # the new slot: set already, or not
    tokens = torch.randint(0, 50000, (b, 3), generator=g).to(DEV)[:, 1]  # a strided column (teacher forcing)
    pos0 = torch.randint(0, slots, (b, 2), generator=g)
    rows = torch.randperm(2 * b + 3, generator=g)[:2 * b].to(DEV)[::2] if with_rows else None  # strided
    masks, pos, got, want = [], [], _buffers(cap), _buffers(cap)
    for fn, out in ((step_inputs.write, got), (step_inputs.reference, want)):
        masks.append(full.to(dtype).to(DEV, copy=True))  # (each its own: both write it)
        pos.append(pos0.to(DEV, copy=True))
        # the engine's views: the mask's row stride total, unit column stride; positions [b, 1], strided
        fn(tokens, pos[-1][:, :1], masks[-1][:, :slots], *out, rows, advance)
    for a, w in zip(got, want):
        assert torch.equal(a, w), (a, w)
    assert torch.equal(masks[0], masks[1]) and torch.equal(pos[0], pos[1])
    expect = full.clone()
    expect[:, slots - 1] = 1
    assert torch.equal(masks[1].long().cpu(), expect)  # the new slot set, nothing else
    assert want[2][:b].tolist() == [slots - int(expect[r].sum()) for r in range(b)]  # the first real slots
    assert want[3].tolist() == [slots] * cap and want[4].item() == slots - 1
    assert want[0][b:].tolist() == [-7] * (cap - b)  # rows past b: their tokens are not touched
    assert want[5].tolist() == (rows.tolist() if with_rows else [-1] * b) + [-1] * (cap - b)
    assert pos[1][:, 0].cpu().tolist() == (pos0[:, 0] + int(advance)).tolist()  # advanced in place, or not
    assert torch.equal(pos[1][:, 1].cpu(), pos0[:, 1])  # the other column untouched


@pytest.mark.parametrize("L,bb,k,R,T", [(1, 1, 1, 1, 1), (3, 4, 2, 5, 9), (48, 2, 8, 3, 40), (5, 8, 3, 8, 7)])
def test_the_routing_record_writes_what_index_put_writes(L, bb, k, R, T):
    g = torch.Generator().manual_seed(L * 100 + bb)
    chosen = torch.randint(0, 128, (L, bb, 1, k), generator=g, dtype=torch.int16).to(DEV)
    rows = torch.randint(0, R, (bb,), generator=g)
    rows[torch.rand(bb, generator=g) < 0.3] = -1  # padding rows of a bucket: nothing recorded
    positions = torch.randint(0, T, (bb,), generator=g)
    if bb > 1:
        rows[0], rows[1] = 0, -1  # one real row, one padding row, whatever the draws
        rows[-1], positions[-1] = min(1, R - 1), T + 2  # past the buffer's slots: nothing recorded
    keep = (rows >= 0) & (positions < T)
    rows, positions = rows.to(DEV), positions.to(DEV)
    wide = torch.full((L, R + 2, T + 5, k), -3, dtype=torch.int16, device=DEV)
    bases = [wide.clone(), wide.clone()]  # the record writes a view (the sampler's rows and slots)
    step_inputs.record(chosen, rows, positions, bases[0][:, :R, :T])
    step_inputs.record_reference(chosen, rows, positions, bases[1][:, :R, :T])
    assert torch.equal(bases[0], bases[1])
    want = wide.clone()  # each kept row's experts at (row, position), nothing else
    for i in range(bb):
        if keep[i]:
            want[:, rows[i], positions[i]] = chosen[:, i, 0]
    assert torch.equal(bases[1], want)
    assert int(keep.sum()) == 0 or not torch.equal(want, wide)


def test_bad_inputs_are_refused():
    mask = torch.ones(2, 6, dtype=torch.long, device=DEV)
    two = torch.zeros(2, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="1 tokens, 2 positions for a mask of 2 rows; pass one of each"):
        step_inputs.write(two[:1], two, mask, *_buffers(4))
    with pytest.raises(ValueError, match="unit column stride"):
        step_inputs.write(two, two, torch.ones(6, 2, dtype=torch.long, device=DEV).t(), *_buffers(4))
    with pytest.raises(ValueError, match="out_tokens holds 1 rows, this step needs 2"):
        step_inputs.write(two, two, mask, *_buffers(1))
    short = list(_buffers(4))
    short[1] = short[1][:1]
    with pytest.raises(ValueError, match="out_positions holds 1 rows"):
        step_inputs.write(two, two, mask, *short)
    with pytest.raises(ValueError, match="tokens on meta"):
        step_inputs.write(two.to("meta"), two, mask, *_buffers(4))
    bad = list(_buffers(4))
    bad[2] = bad[2].long()
    with pytest.raises(ValueError, match="out_starts must be contiguous torch.int32"):
        step_inputs.write(two, two, mask, *bad)
    with pytest.raises(ValueError, match="2 tokens, 2 positions and 1 rows for a mask of 2 rows"):
        step_inputs.write(two, two, mask, *_buffers(4), two[:1])
    with pytest.raises(ValueError, match="the mask has no column"):
        step_inputs.write(two, two, mask[:, :0], *_buffers(4))
    with pytest.raises(ValueError, match="integers to advance in place"):
        step_inputs.write(two, two.double(), mask, *_buffers(4), advance=True)
    chosen = torch.zeros(2, 3, 1, 4, dtype=torch.int16, device=DEV)
    with pytest.raises(ValueError, match=r"out must be \[2, rows, slots, 4\] torch.int16"):
        step_inputs.record(chosen, two, two, torch.zeros(2, 3, 5, 4, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="a row and a position for each of its 3 rows, got 2 rows"):
        step_inputs.record(chosen, two, two, torch.zeros(2, 3, 5, 4, dtype=torch.int16, device=DEV))

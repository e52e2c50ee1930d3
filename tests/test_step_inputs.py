"""fp4rl.kernels.step_inputs: a decode step's inputs in one launch (TRITON_INTERPRET=1 on CPU), equal to the
torch ops it replaces, and its refusals."""
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
            device=DEV))


@pytest.mark.parametrize("b,cap,slots,total,dtype", [
    (1, 1, 5, 5, torch.long), (1, 2, 1, 1, torch.long), (3, 4, 1500, 2100, torch.long),
    (2, 8, 40, 64, torch.bool), (4, 4, 1024, 1024, torch.int32)])
def test_one_launch_writes_what_the_torch_ops_write(b, cap, slots, total, dtype):
    g = torch.Generator().manual_seed(slots)
    full = torch.zeros(b, total, dtype=torch.long)
    for r in range(b):  # left padding of a random length, then real tokens up to the step's slot
        full[r, torch.randint(0, slots, (1,), generator=g).item():slots] = 1
    mask = full.to(dtype).to(DEV)[:, :slots]  # the engine's view: row stride total, unit column stride
    tokens = torch.randint(0, 50000, (b, 3), generator=g).to(DEV)[:, 1]  # a strided column (teacher forcing)
    positions = torch.randint(0, slots, (b, 2), generator=g).to(DEV)[:, :1]  # [b, 1], strided
    got, want = _buffers(cap), _buffers(cap)
    step_inputs.write(tokens, positions, mask, *got)
    step_inputs.reference(tokens, positions, mask, *want)
    for a, w in zip(got, want):
        assert torch.equal(a, w), (a, w)
    assert want[2][:b].tolist() == [slots - int(full[r].sum()) for r in range(b)]  # the first real slots
    assert want[3].tolist() == [slots] * cap and want[4].item() == slots - 1
    assert want[0][b:].tolist() == [-7] * (cap - b)  # rows past b: their tokens are not touched


def test_bad_inputs_are_refused():
    mask = torch.ones(2, 6, dtype=torch.long, device=DEV)
    two = torch.zeros(2, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="one token and one position per mask row"):
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

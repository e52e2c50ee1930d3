"""fp4rl.kernels.fused's launches: split rows (several programs per row, grid (rows, chunks), each writing
its own columns) give the bytes of one program per row for add_rmsnorm and silu_mul, with and without Q(y);
the default chunk of a row; PDL's constexpr and Triton's launch_pdl handed to each launch, the latter only
when PDL is on. On the GPU (-m gpu) the kernels chained under PDL in a CUDA graph give the plain launches'
bytes. The kernels' arithmetic: tests/test_fused_kernels.py (its helpers are shared). On a machine without
CUDA the kernels run in Triton's interpreter (conftest.py)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (decoration time)

from test_fused_kernels import (  # noqa: E402
    DEV,
    QUANTS,
    _bf16,
    _bits_eq,
    _check_pdl_graph,
    _nan_eq,
    _norm,
    _q_eq,
    _quiet,  # noqa: F401  (the shared autouse fixture: quiet numpy warnings under the interpreter)
    _rope_tables,
    assert_bytes,
    assert_norm_close,
)

from fp4rl.kernels import fused  # noqa: E402

# ----------------------------------------------------------------------------------------------
# split rows: several programs per row (grid (rows, chunks)), each writing its own columns


@pytest.mark.parametrize("quant", [None] + QUANTS)
@pytest.mark.parametrize("r,k,chunk,block", [(3, 208, 48, None), (2, 96, 16, 16), (1, 4096, None, None)])
def test_add_rmsnorm_split_rows_are_one_program_per_row_bit_for_bit(r, k, chunk, block, quant):
    """chunk 48 of 208 columns (a partial last chunk, tile 16), chunk 16 (one block per program), the
    default (4096 -> 8 programs of 512): x', y, codes, block scales and global scales equal those of one
    program per row (chunk >= K) and the shared quantizer's, with y on and off, h given and not, a NaN row."""
    x, h, norm = _bf16((r, k), 40, 3.0), _bf16((r, k), 41), _norm(k, 42)
    if r > 2:
        x[1, 7] = float("nan")
    whole = triton_next_pow2(k)
    for hh in (h, None) if quant in (None, QUANTS[2]) else (h,):  # no add: once unquantized, once with 4/6
        xo1, y1, xq1 = fused.add_rmsnorm(x, hh, norm.weight, norm.eps, quant=quant, block=block, chunk=whole)
        xo, y, xq = fused.add_rmsnorm(x, hh, norm.weight, norm.eps, quant=quant, block=block, chunk=chunk)
        if hh is None:
            assert xo is x
        else:
            assert xo.data_ptr() != x.data_ptr()  # x' is a new tensor: programs read all of x's row
            assert _nan_eq(xo, x + h) and _bits_eq(xo, xo1)
        assert _bits_eq(y, y1)
        with torch.no_grad():
            ref = norm(x + h if hh is not None else x)
        fin = ~ref.isnan().any(1)
        assert_norm_close(y[fin], ref[fin])
        if quant is None:
            assert xq is None
            continue
        assert _q_eq(xq, xq1)
        assert_bytes(xq, y, quant)
        xo2, none, xq2 = fused.add_rmsnorm(x, hh, norm.weight, norm.eps, quant=quant, write_y=False,
                                           block=block, chunk=chunk)
        assert none is None and _bits_eq(xo2, xo) and _q_eq(xq2, xq)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("r,i,chunk,block", [(3, 176, 48, None), (2, 96, 32, 16), (1, 3072, None, None)])
def test_silu_mul_split_rows_are_one_program_per_row_bit_for_bit(r, i, chunk, block, quant):
    """As above for SiLU * up with Q(y): chunk 48 of 176 (partial last chunk), 32 with a tile of 16, the
    default (3072 -> 12 programs of 256); y on and off, a row with NaN/Inf."""
    gu = _bf16((r, 2 * i), 43, 3.0)
    if r > 2:
        gu[1, 3], gu[1, 9] = float("nan"), float("inf")
    y1, xq1 = fused.silu_mul(gu, quant=quant, block=block, chunk=triton_next_pow2(i))
    y, xq = fused.silu_mul(gu, quant=quant, block=block, chunk=chunk)
    y_plain, _ = fused.silu_mul(gu, block=block)
    assert _bits_eq(y, y1) and _bits_eq(y, y_plain)
    assert _q_eq(xq, xq1)
    assert_bytes(xq, y, quant)
    none, xq2 = fused.silu_mul(gu, quant=quant, write_y=False, block=block, chunk=chunk)
    assert none is None and _q_eq(xq2, xq)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_split_chunk_choice():
    """Default programs per row: 12 for a 12288-column row and 8 for 4096 at batch 1 (Qwen3-8B's down_proj
    and q/k/v inputs), fewer as rows fill the GPU, never under 256 columns; a chunk is a multiple of 16 and
    the loop's tile divides it."""
    assert fused._chunk(12288, 1, 1024, None) == (1024, 1024)
    assert fused._chunk(4096, 1, 2048, None) == (512, 512)
    assert fused._chunk(12288, 64, 1024, None) == (4096, 1024)
    assert fused._chunk(4096, 256, 2048, None) == (4096, 2048)
    assert fused._chunk(1024, 1, 512, None) == (256, 256)
    assert fused._chunk(80, 1, 128, None) == (128, 128)  # one program for a short row
    assert fused._chunk(208, 3, 512, 48) == (48, 16)
    for bad in (0, 40, -16):
        with pytest.raises(ValueError, match="multiple of 16"):
            fused._chunk(256, 1, 256, bad)


# ----------------------------------------------------------------------------------------------
# PDL: the launch_pdl flag and the PDL constexpr of each launch


def test_launches_pass_launch_pdl_only_with_the_pdl_constexpr(monkeypatch):
    """Each wrapper hands its launch the PDL constexpr and, only when PDL is on (fp4rl.kernels.pdl), Triton's
    launch_pdl; on this machine's device PDL is off. The launches are recorded, not run."""
    seen = {}

    class Spy:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen[self.name] = (grid, kwargs)
            return launch

    from fp4rl.kernels import fused_rope

    for name in ("_add_rmsnorm_kernel", "_silu_mul_kernel"):
        monkeypatch.setattr(fused, name, Spy(name))
    monkeypatch.setattr(fused_rope, "_qk_norm_rope_kernel", Spy("_qk_norm_rope_kernel"))
    r, h, hkv, d = 2, 4, 2, 32
    x, norm = _bf16((r, 64), 44), _norm(64, 45)
    qkv = _bf16((r, (h + 2 * hkv) * d), 46)
    cos, sin = _rope_tables(torch.tensor([1, 2], device=DEV), d)

    def run_all():
        seen.clear()
        fused.add_rmsnorm(x, x, norm.weight, norm.eps, quant=QUANTS[0])
        fused.silu_mul(_bf16((r, 128), 47), quant=QUANTS[0])
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6)
        assert len(seen) == 3
        return [kw for _, kw in seen.values()]

    on_here = fused.pdl.triton_flag(torch.device(DEV))
    for kw in run_all():
        assert kw["PDL"] is on_here and ("launch_pdl" in kw) is on_here
    if DEV == "cpu":
        assert not on_here  # the interpreter has no griddepcontrol
    monkeypatch.setattr(fused.pdl, "triton_flag", lambda device: True)
    for kw in run_all():
        assert kw["PDL"] is True and kw["launch_pdl"] is True
    monkeypatch.setattr(fused.pdl, "triton_flag", lambda device: False)
    for kw in run_all():
        assert kw["PDL"] is False and "launch_pdl" not in kw


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, QUANTS[1]])
def test_gpu_pdl_chain_in_a_cuda_graph_is_the_plain_launch(quant):
    """The three kernels with PDL on, each right after a kernel that writes its input on the same stream (a
    torch copy, then fused kernels that let the next launch at their start), captured in a CUDA graph and
    replayed on new inputs: the same bytes as without PDL (a missing griddepcontrol.wait reads stale data)."""
    from fp4rl.kernels import pdl

    dev = torch.device("cuda")
    was = pdl.is_enabled()
    pdl.set_enabled(True)
    try:
        if not pdl.triton_flag(dev):
            pytest.skip("PDL needs compute capability >= 9 and a Triton with griddepcontrol and launch_pdl")
        r, hq, hkv, d = 4, 16, 4, 128
        k = (hq + 2 * hkv) * d  # add_rmsnorm's y is the qkv of qk_norm_rope
        norm, norm2, qn, kn = _norm(k, 50), _norm(hq * d // 2, 51), _norm(d, 52), _norm(d, 53)
        h0, h2 = _bf16((r, k), 54), _bf16((r, hq * d // 2), 55)
        cos, sin = _rope_tables(torch.tensor([3, 70, 500, 9], device=DEV), d)
        src = torch.empty(r, k, dtype=torch.bfloat16, device=dev)
        xs = torch.empty_like(src)

        def step():
            with pdl.step():  # as the engine's decode step
                xs.copy_(src)  # a plain kernel writes the first input
                x1, y1, q1 = fused.add_rmsnorm(xs, h0, norm.weight, norm.eps, quant=quant)
                q, kk = fused.qk_norm_rope(y1, cos, sin, hq, hkv, d, qn.weight, kn.weight, 1e-6)  # reads y1
                a, aq = fused.silu_mul(q.view(r, hq * d), quant=quant)  # reads q
                x3, y3, q3 = fused.add_rmsnorm(a, h2, norm2.weight, norm2.eps, quant=quant)  # reads a
            outs = [x1, y1, q, kk, a, x3, y3]
            for t in (q1, aq, q3):
                outs += [] if t is None else [t[0], t[1].view(torch.uint8), t[2]]
            return outs

        def plain(seed):
            src.copy_(_bf16((r, k), seed, 2.0))
            pdl.set_enabled(False)
            try:
                return [t.clone() for t in step()]
            finally:
                pdl.set_enabled(True)

        _check_pdl_graph(step, lambda seed: src.copy_(_bf16((r, k), seed, 2.0)),
                         {seed: plain(seed) for seed in (60, 61, 62)})
    finally:
        pdl.set_enabled(was)

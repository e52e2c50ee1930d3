"""The decode step's residual add + RMSNorm split over the two mma16 GEMMs around it (gemv_mma16.cu RN_OUT /
RN_IN; `gemv_cuda.launch(rn_out=, rn_in=)`), so that no launch runs between them: the arithmetic, in torch.

The producer (o_proj or down_proj, a W4A16 GEMM y = bf16(acc g) into the hidden size H) finishes the add and
everything of the norm that needs no reduction over the row:

    x' = bf16(r + y)        the next residual (fused.add_rmsnorm's x', bit for bit)
    xt = bf16(w * x')       the next GEMM's input, w the next RMSNorm's weight
    ss[m, j] = the fp32 sum of x'[m, 16 j .. 16 j + 15]^2   one per row and 16-column n-tile, in a fixed tree

and the consumer (q/k/v or gate | up, K = H) the rest: rstd[m] = 1 / sqrt(sum_j ss[m, j] * float32(1 / H)
+ float32(eps)) (IEEE sqrt and division, the tile sums added in a fixed order), y = bf16((acc g) * rstd[m])
on xt. So the norm's output is never rounded to bf16 before the GEMM, as fused.add_rmsnorm's y = bf16(w *
bf16(x' rstd)) is: not the module step's bits (within bf16 rounding of them), hence a flag
(gpu_decode.RESNORM).

The orders (`tile_sums`, `row_sums`) are the kernels': a tile's 16 squares as the column pairs (c, c + 8),
then an xor butterfly 1, 2, 4 over the 8 pair sums; a row's tile sums by lane l of a warp adding sums l + 32
i in ascending i, then the warp's xor butterfly 16 .. 1 (fp4rl.kernels.prenorm.butterfly). The GEMM's own
sums are the plain launch's; the GPU tests hold the kernels to these functions bit for bit (x', xt, ss) and
to bf16(plain launch on xt * rstd) for y (exact where rstd is a power of two)."""

from __future__ import annotations

import torch

from fp4rl.kernels.prenorm import butterfly, f32_bits  # noqa: F401  (f32_bits: the launch's float args)


def tile_sums(xp: torch.Tensor) -> torch.Tensor:
    """ss [M, N / 16] fp32: the sum of squares of each row's 16-column tiles of x' [M, N] (bf16 values, N a
    multiple of 16) in the producer's tree: the pairs (c, c + 8), then xor 1, 2, 4 over the 8 pair sums."""
    m, n = xp.shape
    if n % 16:
        raise ValueError(f"resnorm.tile_sums: N={n} is not a multiple of 16 (one sum per 16-column n-tile)")
    q = xp.float().reshape(m, n // 16, 16)
    q = q * q  # exact: a bf16 square fits fp32 (down to |x'| ~ 2^-63)
    v = q[..., :8] + q[..., 8:]
    lanes = torch.arange(8, device=xp.device)
    for o in (1, 2, 4):
        v = v + v[..., lanes ^ o]
    return v[..., 0].contiguous()


def row_sums(ss: torch.Tensor) -> torch.Tensor:
    """[M] fp32: each row's tile sums ss [M, P] added as the consumer does (lane l: l + 32 i ascending, zeros
    past P; then the warp's xor butterfly)."""
    m, p = ss.shape
    rounds = -(-p // 32)
    pad = torch.zeros(m, rounds * 32, dtype=torch.float32, device=ss.device)
    pad[:, :p] = ss.float()
    v = pad.view(m, rounds, 32)
    acc = torch.zeros(m, 32, dtype=torch.float32, device=ss.device)
    for i in range(rounds):
        acc = acc + v[:, i]
    return butterfly(acc, torch.add)[:, 0]


def rstd(ss: torch.Tensor, k: int, eps: float) -> torch.Tensor:
    """rstd [M] fp32 from the tile sums ss [M, K / 16]: 1 / sqrt(row_sums * float32(1 / K) + float32(eps))."""
    inv = torch.tensor(1.0 / k, dtype=torch.float32, device=ss.device)
    e = torch.tensor(eps, dtype=torch.float32, device=ss.device)
    return 1.0 / torch.sqrt(row_sums(ss) * inv + e)


def produce(r: torch.Tensor, y: torch.Tensor, weight: torch.Tensor):
    """The producer's epilogue on its rounded output y [M, N] (bf16; the plain launch's): (x', xt, ss) for the
    residual r [M, N] and the next norm's weight [N]."""
    xp = (r.float() + y.float()).bfloat16()
    xt = (weight.float() * xp.float()).bfloat16()
    return xp, xt, tile_sums(xp)


def consume(y_plain: torch.Tensor, ss: torch.Tensor, eps: float) -> torch.Tensor:
    """The consumer's output from the plain launch's y on xt (bf16 [M, N]): bf16(y * rstd) -- the kernel's
    bf16((acc g) rstd) up to the one rounding of acc g that y_plain carries (equal where rstd is a power of
    two). The CPU step's stand-in where no kernel runs."""
    return (y_plain.float() * rstd(ss, 16 * ss.shape[1], eps)[:, None]).bfloat16()


def reference(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x', the norm's output as the GEMM sees it, rstd) of the split: x' = bf16(x + h), xt = bf16(w x'),
    rstd from tile_sums(x'). The GEMM of the result is rstd[m] * (xt @ W.T) (compare fused.add_rmsnorm's
    x' and bf16(w * bf16(x' * rstd)): equal x', a norm output within bf16 rounding)."""
    xp, xt, ss = produce(x, h, weight)
    return xp, xt, rstd(ss, x.shape[1], eps)

"""The 16-point random Hadamard transform (RHT) applied to each block of 16 along the last dim.

y = H16 (D x) / 4, with H16 the Sylvester Hadamard matrix (entries +-1, H16 H16 = 16 I) and
D a diagonal of random signs drawn from a seed. The map is orthogonal, so a matmul over K is
unchanged when both operands are transformed, while outliers are spread over their block,
which lowers the quantization error of heavy-tailed data. The inverse is x = D H16 y / 4.

It is computed as a fast Walsh-Hadamard butterfly (4 stages of a + b, a - b) with an exact
final multiplication by 1/4, never as a BLAS matmul, so every element has one fixed order
of fp32 operations and the result is the same on every device.
"""

from __future__ import annotations

import torch

from fp4rl.nvfp4.format import BLOCK

_signs: dict[tuple[int, torch.device], torch.Tensor] = {}


def hadamard_signs(seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 random signs (float32 +-1) of the transform with this seed, drawn on the CPU."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"hadamard seed must be a non-negative int, got {seed!r}")
    key = (seed, torch.device(device))
    if key not in _signs:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        bits = torch.randint(0, 2, (BLOCK,), generator=gen)
        _signs[key] = (1.0 - 2.0 * bits.to(torch.float32)).to(device)
    return _signs[key]


def _butterfly(x: torch.Tensor) -> torch.Tensor:
    """H16 @ each 16-block of x (float32 [..., n*16]), unnormalized."""
    shape = x.shape
    y = x.reshape(-1, BLOCK)
    half = BLOCK // 2
    while half >= 1:
        y = y.view(-1, BLOCK // (2 * half), 2, half)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        half //= 2
    return y.reshape(shape)


def _check(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise TypeError(f"{name} must be a float32 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.ndim == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"{name} last dim must be a multiple of 16, got shape {tuple(x.shape)}")


def random_hadamard(x: torch.Tensor, seed: int) -> torch.Tensor:
    """y = H16 (D x) / 4 on every 16-block of the last dim of a float32 tensor."""
    _check(x, "x")
    signs = hadamard_signs(seed, x.device)
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK) * signs  # [..., K/16, 16]
    return _butterfly(blocks.reshape(x.shape)) * 0.25


def inverse_random_hadamard(y: torch.Tensor, seed: int) -> torch.Tensor:
    """x = D H16 y / 4: undoes ``random_hadamard(x, seed)`` (up to fp32 rounding)."""
    _check(y, "y")
    signs = hadamard_signs(seed, y.device)
    x = _butterfly(y) * 0.25
    return (x.reshape(*y.shape[:-1], -1, BLOCK) * signs).reshape(y.shape)

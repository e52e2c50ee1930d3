"""decode_attention_rope (fp4rl.kernels.attention): the decode step's q/k-norm + RoPE, KV write and BF16-cache
attention in one launch, against the two kernels it replaces (fused.qk_norm_rope writing the cache slot, then
decode_attention with lengths = slot + 1) and against float32 attention on the cache they leave.

Claims (the function's docstring): without q/k-norm the cache it writes is bit-equal to qk_norm_rope's; with
it the new k within a few bfloat16 ulps (the norm's fp32 sum in another order); the output matches the
two-kernel path up to that and the new token's score (an fp32 sum instead of the MMA); a row that attends only
to the new token returns its v exactly. Runs in Triton's CPU interpreter when there is no CUDA."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (decoration time)

from fp4rl.kernels import attention, fused  # noqa: E402
from fp4rl.model import rope_tables  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _case(r, h, hkv, d, t_cap, slot, norm, seed, b_cap=None):
    """qkv [R, (H + 2 H_kv) D], the RoPE rows of positions near the slot, q/k-norm weights (or None), a
    random bfloat16 cache of b_cap >= R rows (every slot filled: a write must change only its own)."""
    g = _gen(seed)
    qkv = (torch.randn(r, (h + 2 * hkv) * d, generator=g) * 2).bfloat16().to(DEV)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    positions = torch.tensor([slot + 3 * i for i in range(r)], device=DEV)
    cos, sin = rope_tables(inv_freq.to(DEV), positions, torch.bfloat16)  # [R, D]: the engine's tables
    weights = (None, None)
    if norm:
        weights = tuple((torch.rand(d, generator=g) + 0.5).bfloat16().to(DEV) for _ in range(2))
    k = torch.randn(b_cap or r, hkv, t_cap, d, generator=g).bfloat16().to(DEV)
    v = torch.randn(b_cap or r, hkv, t_cap, d, generator=g).bfloat16().to(DEV)
    return qkv, cos, sin, weights, k, v


def _two_kernels(qkv, cos, sin, h, hkv, d, weights, k, v, slot, starts, **kw):
    """What the fused launch replaces: qk_norm_rope writes k / v at the slot, decode_attention attends."""
    r = qkv.shape[0]
    slot_t = torch.tensor([slot], device=DEV)
    q, _ = fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, *weights, 1e-6, k_cache=k, v_cache=v, slot=slot_t)
    lengths = torch.full((r,), slot + 1, dtype=torch.int32, device=DEV)
    out = attention.decode_attention(q[:, :, 0], lengths, k[:r], v[:r], None, None, starts=starts, **kw)
    return q[:, :, 0], out


def _float_attention(q, k, v, slot, starts):
    """float32 GQA attention of q [R, Hq, D] over cache tokens [starts[b], slot] of k, v [B, Hkv, T, D]."""
    r, hq, d = q.shape
    out = torch.zeros(r, hq, d, dtype=torch.float32, device=q.device)
    for i in range(r):
        lo = 0 if starts is None else int(starts[i])
        g = hq // k.shape[1]
        kk = k[i, :, lo:slot + 1].float().repeat_interleave(g, 0)
        vv = v[i, :, lo:slot + 1].float().repeat_interleave(g, 0)
        s = torch.einsum("hd,htd->ht", q[i].float(), kk) / math.sqrt(d)
        out[i] = torch.einsum("ht,htd->hd", s.softmax(-1), vv)
    return out


def ulps(a, b):
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max()) if ia.numel() else 0


# (splits, tiles and min_chunk given where a case needs several active splits: on CUDA the defaults, tuned for
# real caches, keep these tiny ones in one split)
SPLIT2 = {"num_splits": 2, "block_t": 16, "min_chunk": 16}
CASES = [  # r, h, hkv, d, t_cap, slot, starts, norm, decode_attention keywords
    (2, 8, 2, 32, 48, 40, None, False, SPLIT2),  # GQA 4:1, two splits: the slot in the second
    (2, 8, 2, 32, 48, 40, None, True, SPLIT2),  # the same with q/k-norm
    (3, 16, 2, 64, 40, 20, [0, 5, 20], True, {}),  # left padding; row 2 attends only to the new token
    (1, 4, 4, 32, 64, 63, None, False, {"num_splits": 4, "block_t": 16, "min_chunk": 16}),  # MHA, 4 merged
    (2, 8, 1, 32, 33, 0, None, False, {}),  # the first token: nothing in the cache before it
    (2, 8, 2, 32, 64, 50, [3, 0], True, {"num_splits": 1}),  # one split: no workspace, no merge
    (2, 8, 2, 32, 128, 100, None, False, {"num_splits": 8, "block_t": 16, "min_chunk": 32}),
]


@pytest.mark.parametrize("r,h,hkv,d,t_cap,slot,starts,norm,kw", CASES)
def test_one_launch_is_the_two_kernels(r, h, hkv, d, t_cap, slot, starts, norm, kw):
    qkv, cos, sin, weights, k, v = _case(r, h, hkv, d, t_cap, slot, norm, seed=r * 31 + t_cap + slot,
                                         b_cap=r + 1)
    st = None if starts is None else torch.tensor(starts, dtype=torch.int32, device=DEV)
    k_ref, v_ref = k.clone(), v.clone()
    q_ref, ref = _two_kernels(qkv, cos, sin, h, hkv, d, weights, k_ref, v_ref, slot, st, **kw)
    k0, v0 = k.clone(), v.clone()
    out = attention.decode_attention_rope(qkv, cos, sin, h, hkv, d, *weights, 1e-6, k, v,
                                          torch.tensor([slot], device=DEV), starts=st, **kw)
    assert out.shape == (r, h, d) and out.dtype == torch.bfloat16
    # the cache: only slot `slot` of the step's rows changed, v exactly qk_norm_rope's, k too without the norm
    others = torch.ones(t_cap, dtype=torch.bool, device=DEV)
    others[slot] = False
    assert torch.equal(k[:, :, others], k0[:, :, others]) and torch.equal(v[:, :, others], v0[:, :, others])
    assert torch.equal(k[r:], k0[r:]) and torch.equal(v[r:], v0[r:])
    assert torch.equal(v[:r, :, slot], v_ref[:r, :, slot])
    if norm:
        assert ulps(k[:r, :, slot], k_ref[:r, :, slot]) <= 4
    else:
        assert torch.equal(k[:r, :, slot], k_ref[:r, :, slot])
    # the output: the two kernels' up to the new token's score; float attention on the cache it wrote
    assert (out.float() - ref.float()).abs().max().item() < 2e-2
    exact = _float_attention(q_ref, k, v, slot, st)
    assert (out.float() - exact).abs().max().item() < 3e-2 * max(1.0, exact.abs().max().item())
    for i in range(r):  # a row whose only token is the new one: softmax of one score is 1, out = its v
        if starts is not None and starts[i] == slot or slot == 0:
            g = h // hkv
            assert torch.equal(out[i], v[i, :, slot].repeat_interleave(g, 0))


def test_repeated_steps_grow_the_cache_as_the_two_kernels_do():
    """Five decode steps in a row, each writing its slot and attending to every slot before it: the fused
    launch's cache stays bit-equal to the two kernels' (no norm) and the outputs close at every step."""
    r, h, hkv, d, t_cap = 2, 8, 2, 32, 24
    _, _, _, weights, k, v = _case(r, h, hkv, d, t_cap, 0, False, seed=3)
    k_ref, v_ref = k.clone(), v.clone()
    for slot in range(10, 15):
        qkv, cos, sin, _, _, _ = _case(r, h, hkv, d, t_cap, slot, False, seed=100 + slot)
        _, ref = _two_kernels(qkv, cos, sin, h, hkv, d, weights, k_ref, v_ref, slot, None)
        out = attention.decode_attention_rope(qkv, cos, sin, h, hkv, d, *weights, 1e-6, k, v,
                                              torch.tensor([slot], device=DEV))
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref), slot
        assert (out.float() - ref.float()).abs().max().item() < 2e-2, slot


def test_bad_inputs_name_the_problem():
    r, h, hkv, d, t_cap, slot = 2, 8, 2, 32, 16, 5
    qkv, cos, sin, (qw, kw), k, v = _case(r, h, hkv, d, t_cap, slot, True, seed=1)
    s = torch.tensor([slot], device=DEV)
    call = attention.decode_attention_rope
    with pytest.raises(ValueError, match="qkv must be bfloat16"):
        call(qkv.float(), cos, sin, h, hkv, d, qw, kw, 1e-6, k, v, s)
    with pytest.raises(ValueError, match="qkv must be bfloat16"):  # H + 2 H_kv heads do not fit
        call(qkv, cos, sin, h + 1, hkv, d, qw, kw, 1e-6, k, v, s)
    with pytest.raises(ValueError, match="power of two"):
        call(qkv[:, : (h + 2 * hkv) * 24].contiguous(), cos[:, :24], sin[:, :24], h, hkv, 24, None, None,
             1e-6, k[..., :24], v[..., :24], s)
    with pytest.raises(ValueError, match="cos must be bfloat16"):
        call(qkv, cos.float(), sin, h, hkv, d, qw, kw, 1e-6, k, v, s)
    with pytest.raises(ValueError, match="both q_weight and k_weight"):
        call(qkv, cos, sin, h, hkv, d, qw, None, 1e-6, k, v, s)
    with pytest.raises(ValueError, match=r"q_weight must be a contiguous \[32\]"):
        call(qkv, cos, sin, h, hkv, d, qw[:16], kw, 1e-6, k, v, s)
    with pytest.raises(ValueError, match="k_cache must be bfloat16"):
        call(qkv, cos, sin, h, hkv, d, qw, kw, 1e-6, k[:1], v, s)
    with pytest.raises(ValueError, match="v_cache must be bfloat16"):
        call(qkv, cos, sin, h, hkv, d, qw, kw, 1e-6, k, v.float(), s)
    with pytest.raises(ValueError, match=r"slot must be a \[1\] torch.long"):
        call(qkv, cos, sin, h, hkv, d, qw, kw, 1e-6, k, v, s.int())
    with pytest.raises(ValueError, match=r"starts must be \[R=2\]"):
        call(qkv, cos, sin, h, hkv, d, qw, kw, 1e-6, k, v, s, starts=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_splits=-1"):  # an empty grid: no write, no output
        call(qkv, cos, sin, h, hkv, d, qw, kw, 1e-6, k, v, s, num_splits=-1)
    with pytest.raises(ValueError, match="block_t=24"):
        call(qkv, cos, sin, h, hkv, d, qw, kw, 1e-6, k, v, s, block_t=24)


def test_zero_sm_scale_is_honoured():
    """sm_scale=0.0 is a scale (every score 0: the mean of v over the row's tokens), not 1/sqrt(D)."""
    r, h, hkv, d, t_cap, slot = 1, 4, 2, 32, 16, 9
    qkv, cos, sin, _, k, v = _case(r, h, hkv, d, t_cap, slot, False, seed=5)
    out = attention.decode_attention_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6, k, v,
                                          torch.tensor([slot], device=DEV), sm_scale=0.0)
    mean = v[0, :, :slot + 1].float().mean(1).repeat_interleave(h // hkv, 0)  # [H, D], v as written
    assert (out[0].float() - mean).abs().max().item() < 2e-2

"""Decode attention over NVFP4 and FP8 KV caches vs float64 attention on the dequantized cache.

Error sources left: bfloat16 rounding of the probabilities (times the per-token V scale) before
the PV product and of the output, i.e. the usual flash-attention bfloat16 level (< 1e-2
relative). Runs in Triton's CPU interpreter when there is no CUDA."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (decoration time)

from fp4rl.kernels import attention  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-2


def _attn_ref(q, k, v, lengths):
    """float64 GQA attention of q [B, Hq, D] over k, v [B, Hkv, T, D] (first lengths[b] tokens)."""
    b, hq, d = q.shape
    g = hq // k.shape[1]
    out = torch.zeros(b, hq, d, dtype=torch.float64, device=q.device)
    for i in range(b):
        n = int(lengths[i])
        if n == 0:
            continue
        kk = k[i, :, :n].double().repeat_interleave(g, 0)  # [Hq, n, D]
        vv = v[i, :, :n].double().repeat_interleave(g, 0)
        s = torch.einsum("hd,htd->ht", q[i].double(), kk) / math.sqrt(d)
        out[i] = torch.einsum("ht,htd->hd", s.softmax(-1), vv)
    return out


def _case(b, hq, hkv, t, d, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g).bfloat16().to(DEV)
    k = (torch.randn(b, hkv, t, d, generator=g) * 2).to(DEV)
    v = torch.randn(b, hkv, t, d, generator=g).to(DEV)
    return q, k, v, torch.tensor(lengths, dtype=torch.int32, device=DEV)


def _rel(o, ref):
    return ((o.double() - ref).norm() / ref.norm()).item()


def test_nvfp4_cache_gqa_variable_lengths():
    q, k, v, lengths = _case(3, 8, 2, 48, 32, [48, 21, 0])  # includes an empty sequence
    kd, ks, kg = attention.quantize_kv_nvfp4(k)
    vd, vs, vg = attention.quantize_kv_nvfp4(v, scale_rule="4/6")
    qk = reference.quantize(k, scale_scope="row")  # the cache is the reference's per-row NVFP4
    assert torch.equal(kd, qk.data) and torch.equal(kg, qk.global_scale.squeeze(-1))
    ref = _attn_ref(q, reference.dequantize(qk),
                    reference.dequantize(reference.quantize(v, scale_scope="row", scale_rule="4/6")), lengths)
    out = attention.decode_attention(q, lengths, kd, vd, kg, vg, k_scale=ks, v_scale=vs)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert _rel(out, ref) < TOL
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_fp8_cache():
    q, k, v, lengths = _case(2, 4, 4, 40, 32, [40, 17], seed=1)  # MHA (one query head per KV head)
    k8, kg = attention.quantize_kv_fp8(k)
    v8, vg = attention.quantize_kv_fp8(v)
    ref = _attn_ref(q, k8.float() * kg[..., None], v8.float() * vg[..., None], lengths)
    out = attention.decode_attention(q, lengths, k8, v8, kg, vg)
    assert _rel(out, ref) < TOL


def test_bad_inputs():
    q, k, v, lengths = _case(1, 6, 4, 16, 32, [16])
    k8, kg = attention.quantize_kv_fp8(k)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attention.decode_attention(q, lengths, k8, k8, kg, kg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_long_context_repeated():
    q, k, v, lengths = _case(4, 32, 8, 8192, 128, [8192, 5000, 1, 777], seed=3)
    kd, ks, kg = attention.quantize_kv_nvfp4(k)
    vd, vs, vg = attention.quantize_kv_nvfp4(v)
    kq = (kd, ks, kg)
    k_dq = gemm_free_dequant(kq)
    v_dq = gemm_free_dequant((vd, vs, vg))
    ref = _attn_ref(q, k_dq, v_dq, lengths)
    for _ in range(5):  # split merging through counters: must not race
        out = attention.decode_attention(q, lengths, kd, vd, kg, vg, k_scale=ks, v_scale=vs)
        assert _rel(out, ref) < TOL


def gemm_free_dequant(parts):
    data, scale, g = parts
    from fp4rl.nvfp4.format import NVFP4Tensor

    shape = torch.Size((*data.shape[:-1], data.shape[-1] * 2))
    q = NVFP4Tensor(data=data, block_scale=scale, global_scale=g[..., None], shape=shape, dtype=torch.float32)
    return reference.dequantize(q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b,hq,hkv,t,lengths,starts,qscale", [
    (3, 16, 4, 1024, [1024, 17, 0], None, 1.0),  # an empty and a short sequence
    (2, 8, 1, 2048, [2048, 333], None, 30.0),  # 8 query heads per KV head, large q
    (2, 32, 8, 2048, [2048, 1500], [100, 7], 1.0),  # left padding
])
def test_gpu_gluon_kernel(b, hq, hkv, t, lengths, starts, qscale):
    """The Gluon kernel (default for NVFP4, head_dim 128 on sm_90) against float64 attention; V scales over
    8 decades per token; repeated calls give the same bytes (partials merged in split order)."""
    g = torch.Generator().manual_seed(b * 100 + hq)
    q = (torch.randn(b, hq, 128, generator=g) * qscale).bfloat16().to(DEV)
    k = (torch.randn(b, hkv, t, 128, generator=g) * 2).to(DEV)
    v = (torch.randn(b, hkv, t, 128, generator=g) * torch.logspace(-4, 4, t)[None, None, :, None]).to(DEV)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    st = torch.tensor(starts, dtype=torch.int32, device=DEV) if starts else None
    kd, ks, kg = attention.quantize_kv_nvfp4(k)
    vd, vs, vg = attention.quantize_kv_nvfp4(v)
    kf, vf = gemm_free_dequant((kd, ks, kg)), gemm_free_dequant((vd, vs, vg))
    ref = torch.zeros(b, hq, 128, dtype=torch.float64, device=DEV)
    for i in range(b):
        lo = 0 if st is None else int(st[i])
        if lengths[i] > lo:
            ref[i] = _attn_ref(q[i:i + 1], kf[i:i + 1, :, lo:], vf[i:i + 1, :, lo:],
                               torch.tensor([lengths[i] - lo]))[0]
    def run():
        return attention.decode_attention(q, lens, kd, vd, kg, vg, k_scale=ks, v_scale=vs, starts=st,
                                          kernel="gluon")

    out = run()
    assert _rel(out, ref) < TOL
    assert torch.equal(out, run())
    if 0 in lengths:
        assert torch.equal(out[lengths.index(0)], torch.zeros_like(out[0]))


def test_gluon_split_rule(monkeypatch):
    """The dispatcher's split counts on a 132-multiprocessor H200 are the ones measured best there
    (bench/RESULTS.md, eighth session): 6 splits from 16K up at batch 8, 4 below, ~32 at batch 1 32K."""
    props = type("Props", (), {"multi_processor_count": 132})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    got = {(b, t): attention._splits_gluon(b, 8, t, 4, "cuda", 168)
           for b, t in [(8, 2048), (8, 4096), (8, 8192), (8, 16384), (8, 32768), (1, 32768), (1, 4096),
                        (32, 32768)]}
    assert got == {(8, 2048): 4, (8, 4096): 4, (8, 8192): 4, (8, 16384): 6, (8, 32768): 6, (1, 32768): 33,
                   (1, 4096): 16, (32, 32768): 1}
    for (b, t), n in got.items():  # every warp keeps >= 64 tokens, the grid fits the resident CTAs
        assert n == 1 or t // (n * 4) >= 64
        assert b * 8 * n <= 3 * 132 or n == 1

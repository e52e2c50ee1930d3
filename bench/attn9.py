"""Device check + timing of the Gluon NVFP4 decode attention (fp4rl/kernels/attention.py), session 3.

python3 bench/attn9.py --out $OUT/attn9.json: correctness on several shapes (vs float32 SDPA on the
dequantized cache), then batch 8, 32/8 heads, d=128 at 4K and 32K: Gluon (configs), the Triton kernel,
FP8 (Triton), BF16 SDPA, copy bandwidth, all in one process."""

import argparse
import contextlib
import json
import sys
import time
import traceback
import types

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from fp4rl.benchmarks.gpu_kernels import _env, copies_for, copy_bandwidth, time_calls  # noqa: E402
from fp4rl.kernels import attention as A  # noqa: E402
from fp4rl.nvfp4.format import NVFP4Tensor  # noqa: E402
from fp4rl.nvfp4.reference import dequantize  # noqa: E402


def dq(parts, d):
    data, scale, g = parts
    qt = NVFP4Tensor(data=data, block_scale=scale, global_scale=g[..., None],
                     shape=torch.Size((*data.shape[:-1], d)), dtype=torch.float32)
    return dequantize(qt)


def ref_attn(q, kf, vf, lengths, starts=None):
    b, hq, d = q.shape
    out = torch.zeros(b, hq, d, device=q.device, dtype=torch.float32)
    for i in range(b):
        lo = 0 if starts is None else int(starts[i])
        n = int(lengths[i])
        if n <= lo:
            continue
        out[i] = F.scaled_dot_product_attention(q[i:i + 1, :, None].float(), kf[i:i + 1, :, lo:n],
                                                vf[i:i + 1, :, lo:n], enable_gqa=True)[0, :, 0]
    return out


def rel(o, r):
    return ((o.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30)).item()


def timing_inputs(b, t, hq=32, hkv=8, d=128, device="cuda"):
    """The timing case of the attention scripts: random q and BF16 K/V at context t (every sequence full),
    their NVFP4 caches, the float32 reference on the dequantized cache, and enough operand copies of each
    (BF16 sets for SDPA, NVFP4 sets) that the rotation's footprint exceeds the L2 (copies_for)."""
    q = torch.randn(b, hq, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(b, hkv, t, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(b, hkv, t, d, device=device, dtype=torch.bfloat16)
    lengths = torch.full((b,), t, dtype=torch.int32, device=device)
    kq, vq = A.quantize_kv_nvfp4(k), A.quantize_kv_nvfp4(v)
    kv_bf16 = k.nbytes + v.nbytes
    fp4_bytes = sum(p.nbytes for p in kq) + sum(p.nbytes for p in vq)
    return types.SimpleNamespace(
        q=q, q4=q[:, :, None, :], lengths=lengths, kq=kq, vq=vq,
        ref=ref_attn(q, dq(kq, d), dq(vq, d), lengths), kv_bf16=kv_bf16, fp4_bytes=fp4_bytes,
        bf16_sets=[(k, v)] + [(k.clone(), v.clone()) for _ in range(copies_for(kv_bf16, at_least=1) - 1)],
        sets4=[(kq, vq)] + [(tuple(p.clone() for p in kq), tuple(p.clone() for p in vq))
                            for _ in range(copies_for(fp4_bytes, at_least=1) - 1)])


def case_inputs(ci, c, d=128):
    """Correctness case c (seeded by its index ci): q, lengths, starts, the NVFP4 K and V caches (data,
    block scales, per-token scales) and the float32 reference output on the dequantized caches."""
    g = torch.Generator(device="cuda").manual_seed(ci)
    b, hq, hkv, t = c["b"], c["hq"], c["hkv"], c["t"]
    q = (torch.randn(b, hq, d, device="cuda", generator=g) * c["scale"]).bfloat16()
    k = torch.randn(b, hkv, t, d, device="cuda", generator=g) * 2
    v = torch.randn(b, hkv, t, d, device="cuda", generator=g)
    if c.get("vscale_spread"):  # per-token V magnitudes over 8 orders
        v = v * torch.logspace(-4, 4, t, device="cuda")[None, None, :, None]
    lengths = torch.tensor(c["lengths"], dtype=torch.int32, device="cuda")
    starts = torch.tensor(c["starts"], dtype=torch.int32, device="cuda") if "starts" in c else None
    kq, vq = A.quantize_kv_nvfp4(k), A.quantize_kv_nvfp4(v)
    return q, lengths, starts, kq, vq, ref_attn(q, dq(kq, d), dq(vq, d), lengths, starts)


def check(res, **kw):
    cases = [
        dict(b=2, hq=32, hkv=8, t=4096, lengths=[4096, 1000], scale=1.0),
        dict(b=3, hq=16, hkv=4, t=1024, lengths=[1024, 17, 0], scale=1.0),
        dict(b=2, hq=8, hkv=1, t=2048, lengths=[2048, 333], scale=30.0),  # G = 8, large q
        dict(b=2, hq=32, hkv=8, t=2048, lengths=[2048, 1500], starts=[100, 7], scale=1.0),
        dict(b=1, hq=32, hkv=8, t=8192, lengths=[8192], scale=1.0, vscale_spread=True),
    ]
    for ci, c in enumerate(cases):
        hq, hkv = c["hq"], c["hkv"]
        q, lengths, starts, kq, vq, r = case_inputs(ci, c)
        row = {"case": ci, **{kk: vv for kk, vv in c.items()}}
        for name, kern in (("gluon", "gluon"), ("triton", "triton")):
            try:
                o = A.decode_attention(q, lengths, kq[0], vq[0], kq[2], vq[2], k_scale=kq[1], v_scale=vq[1],
                                       starts=starts, kernel=kern, **kw)
                torch.cuda.synchronize()
                row[name] = rel(o, r)
                if name == "gluon":
                    per_h = [rel(o[:, h::hq // hkv], r[:, h::hq // hkv]) for h in range(hq // hkv)]
                    per_d = [rel(o[..., 16 * j:16 * j + 16], r[..., 16 * j:16 * j + 16]) for j in range(8)]
                    row["gluon_per_h"] = per_h
                    row["gluon_per_dblock"] = per_d
                    row["gluon_nan"] = bool(torch.isnan(o).any())
                    o2 = A.decode_attention(q, lengths, kq[0], vq[0], kq[2], vq[2], k_scale=kq[1],
                                            v_scale=vq[1], starts=starts, kernel=kern, **kw)
                    row["gluon_repeat_equal"] = bool(torch.equal(o, o2))
            except Exception as exc:  # noqa: BLE001
                row[name] = repr(exc)[:400]
        print("check", json.dumps(row))
        res.setdefault("check", []).append(row)


def bench(res, bw, contexts, configs):
    b, hq, hkv, d = 8, 32, 8, 128
    for t in contexts:
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
        lengths = torch.full((b,), t, dtype=torch.int32, device="cuda")
        kq, vq = A.quantize_kv_nvfp4(k), A.quantize_kv_nvfp4(v)
        k8, v8 = A.quantize_kv_fp8(k), A.quantize_kv_fp8(v)
        r4 = ref_attn(q, dq(kq, d), dq(vq, d), lengths)
        q4 = q[:, :, None, :]
        kv_bf16 = k.nbytes + v.nbytes
        bf16_sets = [(k, v)] + [(k.clone(), v.clone()) for _ in range(copies_for(kv_bf16, at_least=1) - 1)]
        def sdpa(s, q4=q4):
            return F.scaled_dot_product_attention(q4, s[0], s[1], enable_gqa=True)

        us_sdpa = time_calls([lambda s=s: sdpa(s) for s in bf16_sets], min_calls=8)
        del bf16_sets
        fp4_bytes = sum(p.nbytes for p in kq) + sum(p.nbytes for p in vq)
        fp8_bytes = sum(p.nbytes for p in k8) + sum(p.nbytes for p in v8)
        sets4 = [(kq, vq)] + [(tuple(p.clone() for p in kq), tuple(p.clone() for p in vq))
                              for _ in range(copies_for(fp4_bytes, at_least=1) - 1)]
        base = {"context": t, "batch": b, "hq": hq, "hkv": hkv, "d": d, "sdpa_bf16_us": us_sdpa,
                "floor_us": (fp4_bytes + 2 * q.nbytes) / bw * 1e6,
                "bf16_floor_us": (kv_bf16 + 2 * q.nbytes) / bw * 1e6,
                "fp8_floor_us": (fp8_bytes + 2 * q.nbytes) / bw * 1e6}
        for name, kw in configs + [("triton bt128", dict(kernel="triton", block_t=128))]:
            try:
                def call(s, kw=kw, q=q, lengths=lengths):
                    (kd, ks, kg), (vd, vs, vg) = s
                    return A.decode_attention(q, lengths, kd, vd, kg, vg, k_scale=ks, v_scale=vs, **kw)
                err = rel(call(sets4[0]), r4)
                us = time_calls([lambda s=s: call(s) for s in sets4], min_calls=8)
                row = {**base, "kind": "nvfp4", "config": name, "us": us, "speedup": us_sdpa / us,
                       "rel_err": err}
            except Exception as exc:  # noqa: BLE001
                row = {**base, "kind": "nvfp4", "config": name, "error": repr(exc)[:300]}
            with contextlib.suppress(Exception):  # NVML may be missing
                row["sm_clock_mhz"] = torch.cuda.clock_rate()
            print("bench", json.dumps(row))
            res.setdefault("bench", []).append(row)
        del sets4
        sets8 = [(k8, v8)] + [(tuple(p.clone() for p in k8), tuple(p.clone() for p in v8))
                              for _ in range(copies_for(fp8_bytes, at_least=1) - 1)]
        r8 = ref_attn(q, k8[0].float() * k8[1][..., None], v8[0].float() * v8[1][..., None], lengths)
        for name, kw in (("fp8 triton bt128", dict(block_t=128)),):
            def call8(s, kw=kw, q=q, lengths=lengths):
                (kd, kg), (vd, vg) = s
                return A.decode_attention(q, lengths, kd, vd, kg, vg, **kw)
            err = rel(call8(sets8[0]), r8)
            us = time_calls([lambda s=s: call8(s) for s in sets8], min_calls=8)
            row = {**base, "kind": "fp8", "config": name, "us": us, "speedup": us_sdpa / us, "rel_err": err}
            print("bench", json.dumps(row))
            res.setdefault("bench", []).append(row)
        del sets8
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attn9.json")
    ap.add_argument("--contexts", default="32768,4096")
    ap.add_argument("--configs", default="w4s0,w4s0p0,w4s0p2,w4s0p4,w4s0p6,w2s12,w4s0m1")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--warm-ms", type=float, default=0.0, help="replay each graph this long before timing")
    a = ap.parse_args()
    res = {"env": _env(), "argv": sys.argv}
    import fp4rl.benchmarks.gpu_kernels as gk

    gk.WARM_MS = a.warm_ms
    t0 = time.time()
    if not a.skip_check:
        try:
            check(res)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    print(f"[check {time.time() - t0:.0f}s]")
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    bw = copy_bandwidth()
    res["copy"] = bw
    print(f"copy {bw['tb_s']:.2f} TB/s")
    import re
    configs = []
    for c in a.configs.split(","):  # w<warps>s<splits, 0 = auto>[p<prefetch>][m<asm mode>][r<maxnreg>]
        f = dict(re.findall(r"([wspmrd])(\d+)", c))
        kw = dict(kernel="gluon", num_warps=int(f["w"]), num_splits=int(f.get("s", 0)) or None)
        if "p" in f:
            kw["_pf"] = int(f["p"])
        if "m" in f:
            kw["_mode"] = int(f["m"])
        if "r" in f:
            kw["_maxnreg"] = int(f["r"])
        if "d" in f:
            kw["_dbg"] = int(f["d"])
        configs.append((c, kw))
    bench(res, bw["tb_s"] * 1e12, [int(x) for x in a.contexts.split(",")], configs)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print(f"[total {time.time() - t0:.0f}s]")
    for r in res.get("bench", []):
        print(f"{r['kind']} T={r['context']} {r['config']} [{r.get('sm_clock_mhz', '?')} MHz]: "
              + (f"{r['us']:.1f} us ({r['speedup']:.2f}x SDPA "
              f"{r['sdpa_bf16_us']:.1f}; floor {r['floor_us']:.1f}) err {r['rel_err']:.1e}" if "us" in r
              else r["error"][:150]))
    for r in res.get("check", []):
        gv = r.get("gluon")
        print("check", r["case"], "gluon", gv if isinstance(gv, str) else f"{gv:.2e}",
              "triton", r.get("triton"))


if __name__ == "__main__":
    main()

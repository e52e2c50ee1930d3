"""`fp4rl bench gpu_kernels`: the NVFP4 Triton kernels against torch BF16 and the byte floor.

Everything is measured in one run on one GPU: the copy bandwidth (a device-to-device copy,
bytes read + written), then each kernel next to its BF16 counterpart (cuBLAS matmul, SDPA) and
next to its byte floor = the fewest bytes it must move / that copy bandwidth.

Timing: each measured call is captured in a CUDA graph many times over, cycling through
enough copies of the operands that none is still in L2 when it is read again (the way a
sampler replays a decode step); the figure is the median over replays of (graph time / calls).
Every kernel is checked against the reference in the same run before it is timed.

Sections: copy, quantize, gemm (dense W4A16, shapes N x K = out x in features), moe (grouped
experts), w4a4 (those three in fp4rl.benchmarks.gpu_gemm), attention. Prints a short table per section;
--out writes all of it as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback

import torch

from fp4rl.benchmarks import int_at_least, int_list_at_least

L2_BYTES = 60 * 2**20  # H200; rotation makes the working set several times larger
WARM_MS = 0.0  # set > 0 to replay each graph this long before timing it (steady clocks)
W4A4_ROWS = (1, 16, 128, 512)


def add_arguments(parser):
    parser.add_argument("--sections", default="copy,quantize,gemm,moe,w4a4,attention",
                        help="comma-separated subset of copy,quantize,gemm,moe,w4a4,attention")
    parser.add_argument("--rows", type=int_list_at_least(1), default="1,2,4,8,16,32,64,128,256,512",
                        help="GEMM row counts")
    parser.add_argument("--shapes", type=_shapes, default="4096x14336,14336x4096,4096x6144",
                        help="dense weights as NxK (out x in features), K a multiple of 16")
    parser.add_argument("--context", type=int_list_at_least(1), default="4096,32768",
                        help="attention context lengths")
    parser.add_argument("--out", default=None, help="write all results as JSON here")
    parser.add_argument("--workers", type=int_at_least(0), default=12,
                        help="processes compiling kernels up front (0: none)")


def _shapes(text: str) -> str:
    """argparse type of --shapes: comma-separated NxK, N >= 1, K >= 16 a multiple of 16 (one E4M3 scale per
    16 values along K); returns them cleaned."""
    shapes = []
    for spec in (s.strip() for s in text.split(",") if s.strip()):
        n, _, k = spec.partition("x")
        try:
            n, k = int(n), int(k)
        except ValueError:
            n = k = 0
        if n < 1 or k < 16 or k % 16:
            raise argparse.ArgumentTypeError((f"{spec!r} of " if spec != text.strip() else "") + f"{text!r}: "
                                             "expected NxK, N >= 1 and K a multiple of 16 (e.g. 4096x14336), "
                                             "comma-separated")
        shapes.append(f"{n}x{k}")
    if not shapes:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated NxK (e.g. 4096x14336)")
    return ",".join(shapes)


def _env() -> dict:
    import triton

    p = torch.cuda.get_device_properties(0)
    return {"date": time.strftime("%Y-%m-%d"), "gpu": p.name, "sms": p.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}


def time_calls(calls, min_calls: int = 24, replays: int = 7) -> float:
    """Median microseconds per call of `calls` (zero-arg callables over different operand
    copies), replayed from one CUDA graph (gemm_tune.time_chain, clocks kept busy WARM_MS first)."""
    from fp4rl.kernels import gemm_tune

    for c in calls:  # compile, tune and allocate outside the capture
        c()
    gemm_tune.warm(calls)
    return gemm_tune.time_chain(calls, min_calls, replays, warm_ms=WARM_MS)


def copies_for(nbytes: int, at_least: int = 2, cap: int = 64) -> int:
    """How many copies of an operand of nbytes keep the rotation's footprint >= 4 x L2."""
    return max(at_least, min(cap, math.ceil(4 * L2_BYTES / max(nbytes, 1))))


def copy_bandwidth() -> dict:
    """Device-to-device copy of 1 GiB, bytes read + written, as the best of a copy engine
    (cudaMemcpy) and an SM kernel (elementwise), after warming the clocks up."""
    n = 2**29  # bf16 elements: 1 GiB per buffer
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):  # ~30 ms of matrix work: clocks up
        a @ a
    memcpy = time_calls([lambda: dst.copy_(src)], min_calls=10)
    kernel = time_calls([lambda: torch.mul(src, 1.0, out=dst)], min_calls=10)
    us = min(memcpy, kernel)
    return {"bytes": 4 * n, "us": us, "tb_s": 4 * n / us / 1e6, "memcpy_us": memcpy, "kernel_us": kernel}


def _rel(y, ref) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


# --------------------------------------------------------------------------- quantize


def bench_quantize(bw: float) -> list[dict]:
    """Each mode through quantize_2d (the CUDA kernels where they apply: 1x16, round to nearest) and, in the
    same run, with the CUDA kernels off (the Triton kernels); bytes checked against the reference for both."""
    from fp4rl.kernels.quantize import cuda as qcuda
    from fp4rl.kernels.quantize import quantize_2d
    from fp4rl.nvfp4 import reference

    rows, k = 32768, 4096  # 256 MiB of bf16 (up to the sixth session float32, by type promotion)
    x = (torch.randn(rows, k, device="cuda") * torch.logspace(-2, 2, k, device="cuda")).bfloat16()
    xs = [x] + [x.roll(i, 0) for i in range(1, 2)]
    modes = [
        ("1x16 tensor 6", dict(), dict()),
        ("1x16 row 6", dict(per_row=True), dict(scale_scope="row")),
        ("1x16 row 4/6 mse", dict(per_row=True, scale_rule="4/6"), dict(scale_scope="row", scale_rule="4/6")),
        ("1x16 tensor 4/6 mae", dict(scale_rule="4/6", err="mae"), dict(scale_rule="4/6", err="mae")),
        ("1x16 tensor 4/6 mse", dict(scale_rule="4/6"), dict(scale_rule="4/6")),
        ("16x16 tensor 6", dict(tile16=True), dict(tile=(16, 16))),
        ("16x16 tensor 4/6 mse", dict(tile16=True, scale_rule="4/6"), dict(tile=(16, 16), scale_rule="4/6")),
        ("1x16 row 6 stochastic", dict(per_row=True, stochastic=True), None),
    ]
    out_bytes = rows * k // 2 + rows * k // 16
    moved = rows * k * 2 + out_bytes
    res = []
    for name, kw, ref_kw in modes:
        row = {"mode": name, "rows": rows, "k": k, "floor_us": moved / bw * 1e6}
        on = qcuda.STATE["on"]
        paths = [("", on)] + ([("triton_", False)] if on and qcuda.usable(x) and "16x16" not in name
                              and "stochastic" not in name else [])
        for prefix, cuda_on in paths:
            qcuda.STATE["on"] = cuda_on
            try:
                if ref_kw is not None:  # bytes vs the reference on 4096 rows (slow on the full tensor)
                    d, s, g = quantize_2d(x[:4096], check_finite=False, **kw)
                    q = reference.quantize(x[:4096], **ref_kw)
                    row[prefix + "byte_exact"] = bool(
                        torch.equal(d, q.data) and torch.equal(g.reshape(-1), q.global_scale.reshape(-1))
                        and torch.equal(s.view(torch.uint8), q.block_scale.view(torch.uint8)))
                us = time_calls([lambda xi=xi, kw=kw: quantize_2d(xi, check_finite=False, **kw) for xi in xs],
                                min_calls=6)
            finally:
                qcuda.STATE["on"] = on
            row[prefix + "us"], row[prefix + "tb_s"] = us, moved / us / 1e6
        row["path"] = "cuda" if len(paths) == 2 else "triton"
        res.append(row)
    return res


# --------------------------------------------------------------------------- attention


def bench_attention(bw: float, contexts, b=8, hq=32, hkv=8, d=128) -> list[dict]:
    """SDPA BF16, the NVFP4 kernels and the FP8 kernel at each context, clocks warmed before every timing
    (without it the first timing, SDPA's, ran on cold clocks: 278 vs 245 us at 32K on the H200)."""
    global WARM_MS
    warm, WARM_MS = WARM_MS, max(WARM_MS, 20.0)
    try:
        return _bench_attention(bw, contexts, b, hq, hkv, d)
    finally:
        WARM_MS = warm


def _bench_attention(bw: float, contexts, b, hq, hkv, d) -> list[dict]:
    import torch.nn.functional as F

    from fp4rl.kernels import attention

    res = []
    for t in contexts:
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
        lengths = torch.full((b,), t, dtype=torch.int32, device="cuda")
        kq, vq = attention.quantize_kv_nvfp4(k), attention.quantize_kv_nvfp4(v)
        k8, v8 = attention.quantize_kv_fp8(k), attention.quantize_kv_fp8(v)
        q4 = q[:, :, None, :]

        def sdpa(kk, vv, q4=q4):
            return F.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True)

        # reference: SDPA in float32 on the dequantized NVFP4 cache
        from fp4rl.nvfp4.format import NVFP4Tensor
        from fp4rl.nvfp4.reference import dequantize

        def dq(parts):
            data, scale, g = parts
            qt = NVFP4Tensor(data=data, block_scale=scale, global_scale=g[..., None],
                             shape=torch.Size((*data.shape[:-1], d)), dtype=torch.float32)
            return dequantize(qt)

        ref4 = F.scaled_dot_product_attention(q4.float(), dq(kq), dq(vq), enable_gqa=True)[:, :, 0]
        ref8 = F.scaled_dot_product_attention(q4.float(), k8[0].float() * k8[1][..., None],
                                              v8[0].float() * v8[1][..., None], enable_gqa=True)[:, :, 0]
        kv_bf16 = k.nbytes + v.nbytes
        n_bf16 = copies_for(kv_bf16, at_least=1)
        bf16_sets = [(k, v)] + [(k.clone(), v.clone()) for _ in range(n_bf16 - 1)]
        us_sdpa = time_calls([lambda s=s: sdpa(*s) for s in bf16_sets], min_calls=8)
        fp4_bytes = sum(p.nbytes for p in kq) + sum(p.nbytes for p in vq)
        fp8_bytes = sum(p.nbytes for p in k8) + sum(p.nbytes for p in v8)
        n4 = copies_for(fp4_bytes, at_least=1)
        sets4 = [(kq, vq)] + [(tuple(p.clone() for p in kq), tuple(p.clone() for p in vq))
                              for _ in range(n4 - 1)]
        # NVFP4: the default (the Gluon kernel on sm_90) and the Triton kernel; FP8: Triton only
        variants = [dict(), dict(kernel="triton", block_t=128), dict(kernel="triton", block_t=64)]
        for kind, ref, nbytes in (("nvfp4", ref4, fp4_bytes), ("fp8", ref8, fp8_bytes)):
            best = None
            for var in variants:
                if kind == "nvfp4":
                    def call(s, var=var, q=q, lengths=lengths):
                        (kd, ks, kg), (vd, vs, vg) = s
                        return attention.decode_attention(q, lengths, kd, vd, kg, vg, k_scale=ks, v_scale=vs,
                                                          **var)
                    sets = sets4
                else:
                    def call(s, var=var, q=q, lengths=lengths):
                        (kd, kg), (vd, vg) = s
                        return attention.decode_attention(q, lengths, kd, vd, kg, vg, **var)
                    sets = [(k8, v8)] + [(tuple(p.clone() for p in k8), tuple(p.clone() for p in v8))
                                         for _ in range(copies_for(fp8_bytes, at_least=1) - 1)]
                try:
                    err = _rel(call(sets[0]), ref)
                    us = time_calls([lambda s=s: call(s) for s in sets], min_calls=8)
                except Exception as exc:
                    print(f"attention {kind} {var}: {exc!r}"[:300])
                    continue
                row = {"kind": kind, "context": t, "batch": b, "hq": hq, "hkv": hkv, "d": d, "variant": var,
                       "us": us, "sdpa_bf16_us": us_sdpa, "speedup": us_sdpa / us, "rel_err": err,
                       "floor_us": (nbytes + 2 * q.nbytes) / bw * 1e6,
                       "bf16_floor_us": (kv_bf16 + 2 * q.nbytes) / bw * 1e6}
                res.append(row)
                if best is None or us < best["us"]:
                    best = row
            if best is not None:
                best["best"] = True
            if kind == "nvfp4":
                del sets4
        del bf16_sets
        torch.cuda.empty_cache()
    return res


# --------------------------------------------------------------------------- driver


def _print_table(title, rows, cols):
    print(f"\n## {title}")
    print("| " + " | ".join(c for c, _ in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f(r) for _, f in cols) + " |")


def run(args):
    from fp4rl.benchmarks import gpu_gemm

    if not torch.cuda.is_available():
        print("gpu_kernels needs a CUDA GPU")
        return 1
    # every GEMM candidate timed in this run (its tune log is part of the record), unless FP4RL_TUNE_CACHE
    # says otherwise
    os.environ.setdefault("FP4RL_TUNE_CACHE", "0")
    sections = args.sections.split(",")
    rows_list = [int(v) for v in args.rows.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    out = {"env": _env(), "command": "fp4rl bench gpu_kernels " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if k in ("sections", "rows", "shapes", "context"))}
    print(json.dumps(out["env"]))
    if args.workers > 0:
        t0 = time.time()
        jobs = []
        if "gemm" in sections:
            jobs += [("dense", n, k, m) for n, k in shapes for m in rows_list]
        if "moe" in sections:
            jobs += [("moe", 2048, 768, m) for m in rows_list]
        if "w4a4" in sections:
            jobs += [("w4a4", 14336, 4096, m) for m in W4A4_ROWS if m in rows_list]
        errors = gpu_gemm.precompile(jobs, args.workers) if jobs else []
        print(f"[precompile: {len(jobs)} jobs, {time.time() - t0:.0f} s] {errors[:3]}")
    bw = copy_bandwidth()
    out["copy"] = bw
    print(f"copy bandwidth: {bw['tb_s']:.2f} TB/s (1 GiB: memcpy {bw['memcpy_us']:.0f} us, "
          f"kernel {bw['kernel_us']:.0f} us)")
    tbs = bw["tb_s"] * 1e12
    f1, f2 = (lambda v: f"{v:.1f}"), (lambda v: f"{v:.2f}")
    jobs = {
        "gemm": lambda: gpu_gemm.bench_gemm(tbs, shapes, rows_list),
        "attention": lambda: bench_attention(tbs, [int(v) for v in args.context.split(",")]),
        "quantize": lambda: bench_quantize(tbs),
        "moe": lambda: gpu_gemm.bench_moe(tbs, rows_list),
        "w4a4": lambda: gpu_gemm.bench_w4a4(tbs, [r for r in rows_list if r in W4A4_ROWS] or rows_list[:2]),
    }
    for name, job in jobs.items():
        if name not in sections:
            continue
        t0 = time.time()
        try:
            out[name] = job()
        except Exception:
            traceback.print_exc()
            out[name] = {"error": traceback.format_exc()[-2000:]}
        print(f"[{name}: {time.time() - t0:.0f} s]")
        from fp4rl.kernels import gemm_tune

        out["tune_log"] = {str(k[:7] + k[8:]): v for k, v in gemm_tune.TUNE_LOG.items()}  # all but the device
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(out, fh, indent=1, default=str)
    if isinstance(out.get("quantize"), list):
        _print_table("quantize (32768 x 4096 bf16)", out["quantize"], [
            ("mode", lambda r: r["mode"]), ("path", lambda r: r.get("path", "")),
            ("us", lambda r: f1(r["us"])),
            ("TB/s", lambda r: f2(r["tb_s"])),
            ("Triton us", lambda r: f1(r["triton_us"]) if "triton_us" in r else "-"),
            ("floor us", lambda r: f1(r["floor_us"])),
            ("bytes = ref", lambda r: f"{r.get('byte_exact')}/{r.get('triton_byte_exact', '-')}")])
    if isinstance(out.get("gemm"), list):
        _print_table("W4A16 GEMM (W is N x K)", out["gemm"], [
            ("N x K", lambda r: f"{r['n']}x{r['k']}"), ("rows", lambda r: str(r["rows"])),
            ("nvfp4 us", lambda r: f1(r["us"])), ("bf16 us", lambda r: f1(r["bf16_us"])),
            ("speedup", lambda r: f2(r["speedup"])), ("floor us", lambda r: f1(r["floor_us"])),
            ("rel err", lambda r: f"{r['rel_err']:.1e}"), ("path", lambda r: r["path"]),
            ("gemv32 us", lambda r: f1(r["gemv32_us"]) if "gemv32_us" in r else "-"),
            ("gemv32 x", lambda r: f2(r["gemv32_speedup"]) if "gemv32_us" in r else "-"),
            ("cuda us", lambda r: f1(r["mma16_us"]) if "mma16_us" in r else "-"),
            ("cuda x", lambda r: f2(r["mma16_speedup"]) if "mma16_us" in r else "-"),
            ("cuda path", lambda r: r.get("mma16_path", "-")),
            ("dense copy us", lambda r: f1(r["dense_us"]) if "dense_us" in r else "-"),
            ("dense copy x", lambda r: f2(r["dense_speedup"]) if "dense_us" in r else "-"),
            ("dense copy path", lambda r: r.get("dense_path", "-"))])
    if isinstance(out.get("moe"), list):
        _print_table("grouped experts W4A16 (8 x 2048x768)", out["moe"], [
            ("rows", lambda r: str(r["rows"])), ("active", lambda r: str(r["active"])),
            ("nvfp4 us", lambda r: f1(r["us"])), ("bf16 us", lambda r: f1(r["bf16_us"])),
            ("speedup", lambda r: f2(r["speedup"])), ("floor us", lambda r: f1(r["floor_us"])),
            ("rel err", lambda r: f"{r['rel_err']:.1e}"),
            ("cuda us", lambda r: f1(r["mma16_us"]) if "mma16_us" in r else "-"),
            ("cuda x", lambda r: f2(r["mma16_speedup"]) if "mma16_us" in r else "-"),
            ("dense copy us", lambda r: f1(r["dense_us"]) if "dense_us" in r else "-"),
            ("dense copy x", lambda r: f2(r["dense_speedup"]) if "dense_us" in r else "-"),
            ("dense copy path", lambda r: r.get("dense_path", "-"))])
    if isinstance(out.get("w4a4"), list):
        _print_table("W4A4 emulation (quantize x per token + GEMM), 14336x4096", out["w4a4"], [
            ("rows", lambda r: str(r["rows"])), ("us", lambda r: f1(r["us"])),
            ("bf16 us", lambda r: f1(r["bf16_us"])), ("speedup", lambda r: f2(r["speedup"])),
            ("rel err", lambda r: f"{r['rel_err_vs_fake_quant']:.1e}")])
    if isinstance(out.get("attention"), list):
        _print_table("decode attention, batch 8, 32/8 heads, d=128 (best variant)",
                     [r for r in out["attention"] if r.get("best")], [
            ("cache", lambda r: r["kind"]), ("context", lambda r: str(r["context"])),
            ("us", lambda r: f1(r["us"])),
            ("sdpa bf16 us", lambda r: f1(r["sdpa_bf16_us"])), ("speedup", lambda r: f2(r["speedup"])),
            ("floor us", lambda r: f1(r["floor_us"])), ("rel err", lambda r: f"{r['rel_err']:.1e}"),
            ("variant", lambda r: str(r["variant"]))])
    return 0


def dump_compiled(path: str) -> dict:
    """Registers / spills of the last compiled kernel of each family, and their PTX (to path)."""
    from fp4rl.kernels._common import ASM, COMPILED

    info = {"asm_unpack": ASM["on"]}
    with open(path, "w") as fh:
        for name, ck in COMPILED.items():
            info[name] = {"regs": getattr(ck, "n_regs", None), "spills": getattr(ck, "n_spills", None)}
            fh.write(f"//// {name}\n{ck.asm.get('ptx', '')}\n")
    return info


if __name__ == "__main__":
    import sys

    _parser = argparse.ArgumentParser(prog="python -m fp4rl.benchmarks.gpu_kernels")
    add_arguments(_parser)
    _parser.add_argument("--ptx", default=None, help="write the compiled kernels' PTX here")
    _args = _parser.parse_args()
    _code = run(_args)
    if _args.ptx:
        print(json.dumps(dump_compiled(_args.ptx)))
    sys.exit(_code)

"""The GEMM sections of `fp4rl bench gpu_kernels`: dense W4A16 (gemm), routed experts (moe) and W4A4 (w4a4)
against cuBLAS BF16 and the byte floor, each path the sampler can take (the tuned Triton / Gluon kernels, the
CUDA mma16 and wgmma builds, the grouped CUDA kernel, cuBLAS on a dense copy), and the parallel precompile of
their candidates. Timing and the copy bandwidth: fp4rl.benchmarks.gpu_kernels."""

from __future__ import annotations

import torch

from fp4rl.benchmarks.gpu_kernels import _rel, copies_for, time_calls


def _warm_job(job):
    """Run one tuning job in a worker process so that its kernels land in Triton's disk cache."""
    kind, n, k, m = job
    from fp4rl.kernels import gemm
    from fp4rl.nvfp4.format import NVFP4Tensor

    e = 8 if kind in ("moe",) else 1
    shape = (e, n, k) if e > 1 else (n, k)
    data = torch.randint(0, 256, (*shape[:-1], k // 2), dtype=torch.uint8, device="cuda")
    scale = (torch.rand(*shape[:-1], k // 16, device="cuda") + 0.5).to(torch.float8_e4m3fn)
    g = torch.full((e,) if e > 1 else (), 1e-3, device="cuda")
    w = NVFP4Tensor(data=data, block_scale=scale, global_scale=g, shape=torch.Size(shape),
                    dtype=torch.float32)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    try:
        if kind == "dense":
            gemm.linear(x, w)
        elif kind == "w4a4":
            gemm.linear_w4a4(x, w)
        else:
            counts = [m // e + (1 if i < m % e else 0) for i in range(e)]
            offs = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32, device="cuda")
            gemm.grouped_linear(x, w, offs)
    except Exception as exc:
        return f"{job}: {exc!r}"[:300]
    return None


def precompile(jobs, workers: int = 12) -> list:
    """Compile every candidate kernel of these jobs in parallel processes (shared disk cache)."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        return [r for r in pool.map(_warm_job, jobs, chunksize=1) if r]


# --------------------------------------------------------------------------- dense GEMM


def _nvfp4_weight(n, k, seed=0):
    from fp4rl.nvfp4 import reference

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    return w.bfloat16(), reference.quantize(w)


def bench_gemm(bw: float, shapes, rows_list) -> list[dict]:
    from types import SimpleNamespace

    from fp4rl.kernels import gemm, gemm_tune
    from fp4rl.kernels import gemv as _gemv
    from fp4rl.kernels import gemv_cuda as _mma16
    from fp4rl.nvfp4 import reference
    from fp4rl.nvfp4.format import NVFP4Tensor

    res = []
    for n, k in shapes:
        w_bf16, wq = _nvfp4_weight(n, k)
        fp4_bytes = wq.data.nbytes + wq.block_scale.nbytes
        n_fp4 = copies_for(fp4_bytes)
        n_bf16 = copies_for(w_bf16.nbytes)
        wqs = [wq] + [NVFP4Tensor(data=wq.data.clone(), block_scale=wq.block_scale.clone(),
                                  global_scale=wq.global_scale.clone(), shape=wq.shape, dtype=wq.dtype)
                      for _ in range(n_fp4 - 1)]
        wbs = [w_bf16] + [w_bf16.clone() for _ in range(n_bf16 - 1)]
        w_ref = reference.dequantize(wq).double()
        wms = None  # the same weights carrying the CUDA kernel's copy (what the sampler's linears hold)
        if _mma16.available() and _mma16.supports(n, k):
            wms = [SimpleNamespace(data=q.data, block_scale=q.block_scale, global_scale=q.global_scale,
                                   mma16=_mma16.relayout(q.data, q.block_scale)) for q in wqs]
        # the dense copies (Sampler(dense_rows=)) once per shape, for the rows past the mma16 kernel's
        dense = _dense_copies(wqs, wbs) if any(m > gemm.MMA16_MAX_ROWS for m in rows_list) else None
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = gemm.linear(x, wq)  # tunes this (rows bucket, N, K) once
            err = _rel(y, x.double() @ w_ref.T)
            key = next(kk for kk in gemm_tune._TUNED
                       if kk[:3] == (gemm_tune._bucket(m), n, k // 2) and not kk[4] and not kk[5]
                       and not kk[gemm_tune.KEY_WIDE] and not kk[gemm_tune.KEY_LAYOUT]
                       and not kk[gemm_tune.KEY_DENSE])
            cfg = gemm_tune._TUNED[key]
            us = time_calls([lambda w=w, x=x: gemm.linear(x, w) for w in wqs])
            us_bf16 = time_calls([lambda w=w, x=x: torch.matmul(x, w.t()) for w in wbs])
            io = x.nbytes + m * n * 2
            extra = {}
            if m <= _gemv.MAX_ROWS and _gemv.available():  # the same weights, codes in the gemv32 layout
                wsw = [SimpleNamespace(data=q.data, block_scale=q.block_scale, global_scale=q.global_scale,
                                       gemv32=_gemv.swizzle(q.data)) for q in wqs]
                ysw = gemm.linear(x, wsw[0])
                extra = {"gemv32_us": time_calls([lambda w=w, x=x: gemm.linear(x, w) for w in wsw]),
                         "gemv32_rel_err": _rel(ysw, x.double() @ w_ref.T),
                         "gemv32_path": _path(gemm_tune._TUNED[key[:gemm_tune.KEY_LAYOUT] + (1,)
                                                          + key[gemm_tune.KEY_LAYOUT + 1:]])}
                extra["gemv32_speedup"] = us_bf16 / extra["gemv32_us"]
                del wsw
            if wms is not None and (m <= gemm.MMA16_MAX_ROWS or ((gemm.wide_rows(m, n)
                                                                  or gemm.wide_candidate(m, n))
                                                                 and _mma16.wide_available())):
                # gemm.gemm's dispatch: mma.sync up to 16 rows, wgmma above (wide_rows), else the tuner's pick
                # with wgmma as a candidate
                ym = gemm.linear(x, wms[0])
                path = "mma16" if m <= gemm.MMA16_MAX_ROWS else "wgmma"
                if gemm.wide_candidate(m, n):  # the tuner's pick (none: the wgmma build failed and is off)
                    wkey = next((kk for kk in gemm_tune._TUNED if kk[:3] == (gemm_tune._bucket(m), n, k // 2)
                                 and not kk[4] and not kk[5] and kk[gemm_tune.KEY_WIDE]
                                 and not kk[gemm_tune.KEY_LAYOUT] and not kk[gemm_tune.KEY_DENSE]), None)
                    path = _path(gemm_tune._TUNED[wkey]) if wkey is not None else "tuned without wgmma"
                extra.update(mma16_us=time_calls([lambda w=w, x=x: gemm.linear(x, w) for w in wms]),
                             mma16_rel_err=_rel(ym, x.double() @ w_ref.T), mma16_path=path)
                extra["mma16_speedup"] = us_bf16 / extra["mma16_us"]
            if m > gemm.MMA16_MAX_ROWS:  # the sampler's linear with its dense copy (dense_rows <= m): the
                # tuner's pick of cuBLAS on DQ(W) and the 4-bit kernels (mma16 copy too where it has one)
                wds = [SimpleNamespace(data=q.data, block_scale=q.block_scale, global_scale=q.global_scale,
                                       mma16=None if wms is None else wm.mma16, dense=wb)
                       for q, wm, wb in zip(wqs, wms or [None] * len(wqs), dense)]
                yd = gemm.linear(x, wds[0])
                dkey = next(kk for kk in gemm_tune._TUNED if kk[:3] == (gemm_tune._bucket(m), n, k // 2)
                            and not kk[4] and not kk[5] and not kk[gemm_tune.KEY_LAYOUT]
                            and kk[gemm_tune.KEY_DENSE])
                extra.update(dense_us=time_calls([lambda w=w, x=x: gemm.linear(x, w) for w in wds]),
                             dense_rel_err=_rel(yd, x.double() @ w_ref.T),
                             dense_path=_path(gemm_tune._TUNED[dkey]))
                extra["dense_speedup"] = us_bf16 / extra["dense_us"]
                del wds
            res.append({"n": n, "k": k, "rows": m, "us": us, "bf16_us": us_bf16, "speedup": us_bf16 / us,
                        "floor_us": (fp4_bytes + io) / bw * 1e6,
                        "bf16_floor_us": (w_bf16.nbytes + io) / bw * 1e6,
                        "rel_err": err, "path": cfg if isinstance(cfg, str) else _path(cfg), **extra})
        del wqs, wbs, wms, dense
        torch.cuda.empty_cache()
    return res


def _dense_copies(wqs, wbs) -> list:
    """DQ(W) in bfloat16 (what Sampler(dense_rows=) keeps) of each weight copy wqs[i]: the first computed, the
    others clones (in fresh memory, as the BF16 rotation's wbs are, and never more of them than wbs)."""
    from fp4rl.kernels.dequantize import dequantize

    q = wqs[0]
    first = dequantize(q.data, q.block_scale, q.global_scale, torch.float32).to(torch.bfloat16)
    first = first.reshape(wbs[0].shape)
    out = [first] + [first.clone() for _ in range(min(len(wqs), len(wbs)) - 1)]
    return [out[i % len(out)] for i in range(len(wqs))]


def _path(c) -> str:
    if isinstance(c, str):  # gemm_tune.FALLBACK, WIDE, DENSE
        return c
    return ("" if c.get("KIND") else "decode " if c["SWAP"] else "prefill ") + _cfg_str(c)


def _cfg_str(c) -> str:
    if c.get("KIND") == "gemv_mma":
        return f"gluon-mma-gemv L{c['LAYOUT']} R{c['R']} w{c['num_warps']} S{c['SPLIT_K']}"
    return f"BM{c['BM']} BN{c['BN']} BK{c['BK']} S{c['SPLIT_K']} w{c['num_warps']} s{c['num_stages']}"


# --------------------------------------------------------------------------- grouped experts


def bench_moe(bw: float, rows_list, experts=8, n=2048, k=768) -> list[dict]:
    from types import SimpleNamespace

    from fp4rl.kernels import gemm, gemm_tune
    from fp4rl.kernels import gemv_cuda as _mma16
    from fp4rl.kernels import gemv_cuda_grouped as _mma16_grouped
    from fp4rl.nvfp4 import reference
    from fp4rl.nvfp4.format import NVFP4Tensor

    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(experts, n, k, device="cuda", generator=g) * 0.02
    qs = [reference.quantize(w[e]) for e in range(experts)]
    wq = NVFP4Tensor(data=torch.stack([q.data for q in qs]),
                     block_scale=torch.stack([q.block_scale for q in qs]),
                     global_scale=torch.stack([q.global_scale for q in qs]), shape=w.shape, dtype=w.dtype)
    w_bf16 = w.bfloat16()
    per_expert_fp4 = wq.data[0].nbytes + wq.block_scale[0].nbytes
    n_fp4 = copies_for(wq.data.nbytes + wq.block_scale.nbytes)
    n_bf16 = copies_for(w_bf16.nbytes)
    wqs = [wq] + [NVFP4Tensor(data=wq.data.clone(), block_scale=wq.block_scale.clone(),
                              global_scale=wq.global_scale.clone(), shape=wq.shape, dtype=wq.dtype)
                  for _ in range(n_fp4 - 1)]
    wbs = [w_bf16] + [w_bf16.clone() for _ in range(n_bf16 - 1)]
    w_ref = torch.stack([reference.dequantize(q) for q in qs]).double()
    grouped_mm = getattr(torch, "_grouped_mm", None)
    dense = _dense_copies(wqs, wbs) if grouped_mm is not None else None  # Sampler(dense_rows=)'s copies
    res = []
    for m in rows_list:
        counts = [m // experts + (1 if e < m % experts else 0) for e in range(experts)]
        offs = [0]
        for c in counts:
            offs.append(offs[-1] + c)
        offsets = torch.tensor(offs, dtype=torch.int32, device="cuda")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = gemm.grouped_linear(x, wq, offsets)
        ref = torch.cat([x[offs[e]:offs[e + 1]].double() @ w_ref[e].T for e in range(experts)])
        err = _rel(y, ref)
        us = time_calls([lambda wi=wi, x=x, o=offsets: gemm.grouped_linear(x, wi, o) for wi in wqs])
        active = [e for e in range(experts) if counts[e]]
        slices = [(x[offs[e]:offs[e + 1]], e) for e in active]

        def loop(wb, slices=slices):
            return [torch.matmul(xe, wb[e].t()) for xe, e in slices]

        base = {"loop": time_calls([lambda wb=wb: loop(wb) for wb in wbs])}
        if grouped_mm is not None:
            try:
                ends = offsets[1:].contiguous()
                wbt = [wb.transpose(1, 2) for wb in wbs]  # [E, K, N] views
                grouped_mm(x, wbt[0], offs=ends)
                base["grouped_mm"] = time_calls([lambda wt=wt, x=x, o=ends: grouped_mm(x, wt, offs=o)
                                                 for wt in wbt])
            except Exception as exc:  # not supported on this build / GPU
                base["grouped_mm_error"] = repr(exc)[:120]
        best = min(v for v in base.values() if isinstance(v, float))
        moved = len(active) * per_expert_fp4 + x.nbytes + m * n * 2
        extra = {}
        if _mma16.available() and _mma16.supports(n, k):
            # the grouped CUDA kernel on the experts' mma16 copy (the sampler's path while the rows per expert
            # are few, gemm.MMA16_GROUPED_ROWS_PER_EXPERT), launched directly at every row count
            wms = [(_mma16_grouped.relayout_stack(q.data, q.block_scale), q.global_scale) for q in wqs]

            def grouped(wm, x=x, o=offsets):
                y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
                return _mma16_grouped.launch_grouped(x, wm[0], wm[1], o, y)

            ym = grouped(wms[0])
            calls = [lambda wm=wm: grouped(wm) for wm in wms]
            extra = {"mma16_us": time_calls(calls), "mma16_rel_err": _rel(ym, ref)}
            extra["mma16_speedup"] = best / extra["mma16_us"]
            del wms, calls
        if grouped_mm is not None and "grouped_mm" in base:  # with the experts' dense copy (dense_rows <= m)
            wds = [SimpleNamespace(data=q.data, block_scale=q.block_scale, global_scale=q.global_scale,
                                   dense=d) for q, d in zip(wqs, dense)]
            yd = gemm.grouped_linear(x, wds[0], offsets)
            bucket = gemm_tune._bucket(m)
            dkey = next(kk for kk in gemm_tune._TUNED if kk[:5] == (bucket, n, k // 2, experts, True)
                        and not kk[5] and kk[gemm_tune.KEY_DENSE])
            extra.update(dense_us=time_calls([lambda w=w, x=x, o=offsets: gemm.grouped_linear(x, w, o)
                                              for w in wds]),
                         dense_rel_err=_rel(yd, ref), dense_path=_path(gemm_tune._TUNED[dkey]))
            extra["dense_speedup"] = best / extra["dense_us"]
            del wds
        res.append({"experts": experts, "n": n, "k": k, "rows": m, "active": len(active), "us": us,
                    "bf16_us": best, "bf16_variants": base, "speedup": best / us,
                    "floor_us": moved / bw * 1e6, "rel_err": err, **extra})
    return res


# --------------------------------------------------------------------------- W4A4 emulation


def bench_w4a4(bw: float, rows_list, n=14336, k=4096) -> list[dict]:
    from fp4rl.kernels import gemm
    from fp4rl.nvfp4 import reference

    w_bf16, wq = _nvfp4_weight(n, k, seed=2)
    w_ref = reference.dequantize(wq).double()
    n_fp4 = copies_for(wq.data.nbytes)
    wqs = [wq] * 1 + [type(wq)(data=wq.data.clone(), block_scale=wq.block_scale.clone(),
                               global_scale=wq.global_scale.clone(), shape=wq.shape, dtype=wq.dtype)
                      for _ in range(n_fp4 - 1)]
    res = []
    for m in rows_list:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xq = reference.quantize(x, scale_scope="row")
        ref = reference.dequantize(xq).double() @ w_ref.T
        err = _rel(gemm.linear_w4a4(x, wq), ref)
        us = time_calls([lambda w=w, x=x: gemm.linear_w4a4(x, w) for w in wqs])
        us_bf16 = time_calls([lambda x=x: torch.matmul(x, w_bf16.t())] * 2)
        res.append({"n": n, "k": k, "rows": m, "us": us, "bf16_us": us_bf16, "speedup": us_bf16 / us,
                    "rel_err_vs_fake_quant": err})
    return res

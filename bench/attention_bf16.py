"""Decode attention over the BF16 KV cache: fp4rl.kernels.attention.decode_attention (the Triton kernel's BF16
branch) against torch SDPA exactly as fp4rl.gpu_decode calls it (additive mask over all T_cap slots, GQA by
enable_gqa), Qwen3-30B-A3B's heads (32 query, 4 KV, head_dim 128) by default.

    python3 bench/attention_bf16.py [--batch 1,8,32] [--context 64,512,4096,32768] [--tcap N] [--heads 32,4]
        [--d 128] [--variants default,bt64-sp8] [--rounds 7] [--kernel-info] [--kv bf16|fp8] [--out FILE.json]

--kv fp8 times the same kernel's FP8 branch over an FP8 cache (attention.quantize_kv_fp8: codes and a float32
scale per token and head; 'default' is then `_splits_fp8` and 128-token tiles), SDPA and the float32 reference
over its dequantized values.

Per (batch, context): T_cap = the context rounded up to 64 (or --tcap, to time short rows in a large cache),
every row holds `context` tokens (starts 0). Both are timed under CUDA graph replay (`interleaved`: reps
calls captured in one graph per variant, --rounds rounds replaying every graph once in a rotated order after
warming the clocks, the median, us per call), over rotated copies of the cache (>= 3x L2 in all, at most 1024
copies) so that K and V come from HBM as in a 48-layer decode step. Before any timing every variant's output
is checked against float32 attention and against SDPA's own output: a mismatch stops the run (exit status 1),
it is not timed.

--variants: our kernel's launch settings, '-'-joined tokens: bt<block_t>, w<num_warps>, s<num_stages>,
sp<num_splits>, mc<min_chunk>; 'default' = the dispatcher's choice (attention.BF16_TUNE,
_splits_bf16).
"""

import argparse
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gemm_fixed import capture  # noqa: E402  (fn(0), then reps calls captured in one CUDA graph)

from fp4rl.kernels import attention  # noqa: E402

KEYS = {"bt": "block_t", "w": "num_warps", "s": "num_stages", "sp": "num_splits", "mc": "min_chunk"}
REL_TOL, ABS_TOL = 1e-2, 3e-2


def parse_variant(name: str) -> dict:
    if name == "default":
        return {}
    kw = {}
    for tok in name.split("-"):
        key = tok.rstrip("0123456789")
        if key not in KEYS or key == tok:
            raise SystemExit(f"bad variant token {tok!r} in {name!r} (use {', '.join(KEYS)} + a number)")
        kw[KEYS[key]] = int(tok[len(key):])
    return kw


def additive_mask(lengths, starts, t_cap, dtype):
    """fp4rl.gpu_decode._context's mask: [B, T_cap], 0 on [starts, lengths), -inf elsewhere."""
    key = torch.arange(t_cap, device=lengths.device)
    visible = (key[None] >= starts[:, None]) & (key[None] < lengths[:, None])
    mask = torch.zeros(visible.shape, dtype=dtype, device=lengths.device)
    return mask.masked_fill_(~visible, float("-inf"))


def reference(q, k, v, lengths, starts):
    """float32 attention per row over tokens [starts, lengths) (GQA by repeating the KV heads)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    g = q.shape[1] // k.shape[1]
    for i in range(q.shape[0]):
        lo, hi = int(starts[i]), int(lengths[i])
        if hi > lo:
            kk = k[i, :, lo:hi].float().repeat_interleave(g, 0)
            vv = v[i, :, lo:hi].float().repeat_interleave(g, 0)
            s = torch.einsum("hd,htd->ht", q[i].float(), kk) / math.sqrt(q.shape[2])
            out[i] = torch.einsum("ht,htd->hd", s.softmax(-1), vv)
    return out


def check(name, out, ref, sdpa):
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    err = (out.float() - ref).abs().max().item()
    vs_sdpa = (out.float() - sdpa.float()).abs().max().item()
    if not (torch.isfinite(out).all() and rel < REL_TOL and err < ABS_TOL and vs_sdpa < ABS_TOL):
        print(f"MISMATCH {name}: rel err {rel:.3g} (< {REL_TOL}), max abs err {err:.3g}, max abs vs SDPA "
              f"{vs_sdpa:.3g} (< {ABS_TOL}), finite {bool(torch.isfinite(out).all())}", flush=True)
        raise SystemExit(1)
    return rel


def kernel_info(k) -> dict:
    """Registers, spills, shared memory and asynchronous copies (cp.async / TMA) of a compiled kernel."""
    if k is None:
        return {}
    ptx = k.asm.get("ptx", "") if hasattr(k, "asm") else ""
    return {"regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
            "shared": getattr(getattr(k, "metadata", None), "shared", None),
            "cp_async": ptx.count("cp.async."), "tma": ptx.count("cp.async.bulk")}


def warm_clocks(ms=20.0):
    """Keep the GPU busy ~ms so that the SM clock is up before a timing (an idle H200 drops it)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) >= ms:
            return


def interleaved(calls: dict, reps: int, rounds: int) -> dict:
    """Microseconds per call of each fn(r) in `calls`: reps calls r = 0..reps-1 captured in one CUDA graph per
    entry, then `rounds` rounds that replay every graph once, in an order rotated each round, after the clocks
    are warmed; the median per entry. (Timing one entry's rounds after another's, as bench/gemm_fixed.timed
    does, put ~1 us on some entries by their place in the list: the fiftieth session's FP8 sweep timed its
    first variant 8.6 us and the same launch 9.9 us a few entries later.)"""
    graphs, keep = {}, []
    for name, fn in calls.items():
        graphs[name] = capture(fn, reps)
        keep.append(dict(attention._WORKSPACE.bufs))  # this graph's split workspaces, if a later one grows
    names, ts = list(graphs), {name: [] for name in graphs}
    for i in range(rounds):
        warm_clocks()
        for name in names[i % len(names):] + names[:i % len(names)]:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[name].replay()
            b.record()
            torch.cuda.synchronize()
            ts[name].append(a.elapsed_time(b) * 1e3 / reps)
    return {name: statistics.median(v) for name, v in ts.items()}


def run_shape(batch, context, t_cap, hq, hkv, d, variants, rounds, l2, kv="bf16"):
    g = torch.Generator(device="cuda").manual_seed(batch * 100003 + context)
    q = torch.randn(batch, hq, d, device="cuda", generator=g).bfloat16()
    k0 = (torch.randn(batch, hkv, t_cap, d, device="cuda", generator=g) * 2).bfloat16()
    v0 = torch.randn(batch, hkv, t_cap, d, device="cuda", generator=g).bfloat16()
    if kv == "fp8":  # our kernel reads the FP8 cache; SDPA and the reference its dequantized values
        k8, kg = attention.quantize_kv_fp8(k0)
        v8, vg = attention.quantize_kv_fp8(v0)
        ours = (k8, v8, kg, vg)
        k0 = (k8.float() * kg[..., None]).bfloat16()
        v0 = (v8.float() * vg[..., None]).bfloat16()
    else:
        ours = (k0, v0, None, None)
    lengths = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    starts = torch.zeros(batch, dtype=torch.int32, device="cuda")
    mask = additive_mask(lengths, starts, t_cap, k0.dtype)
    q4 = q[:, :, None]

    def sdpa(kk, vv):
        return F.scaled_dot_product_attention(q4, kk, vv, attn_mask=mask[:, None, None],
                                              enable_gqa=hq != hkv)[:, :, 0]

    ref = reference(q, k0, v0, lengths, starts)
    sdpa_out = sdpa(k0, v0)
    check(f"SDPA itself, batch {batch} context {context}", sdpa_out, ref, sdpa_out)
    outs, info = {}, {}
    for name, kw in variants.items():
        outs[name] = attention.decode_attention(q, lengths, *ours, starts=starts, **kw)
        check(f"{name}, batch {batch} context {context}", outs[name], ref, sdpa_out)
        info[name] = kernel_info(attention.COMPILED.get(f"decode_attn {kv}"))
    nbytes = 2 * k0.numel() * k0.element_size()  # K and V, every slot (SDPA reads all T_cap)
    per_token = d * 2 if kv == "bf16" else d + 4  # FP8: the codes and a float32 scale
    read = 2 * batch * hkv * context * per_token  # what our kernel reads
    copies = max(1, min(1024, -(-3 * l2 // nbytes)))
    caches = [(k0, v0)] + [(k0.clone(), v0.clone()) for _ in range(copies - 1)]
    mine = [ours] + [tuple(None if t is None else t.clone() for t in ours) for _ in range(copies - 1)]
    reps = max(copies, 8)
    splits = (attention._splits_bf16(batch, hkv, t_cap, q.device) if kv == "bf16"
              else attention._splits_fp8(batch, hkv, t_cap, q.device))
    row = {"batch": batch, "context": context, "t_cap": t_cap, "hq": hq, "hkv": hkv, "d": d, "kv": kv,
           "copies": copies, "splits_default": splits, "mb_read": read / 1e6}
    calls = {"sdpa": lambda r: sdpa(*caches[r % copies])}
    for name, kw in variants.items():
        calls[name] = (lambda r, kw=kw: attention.decode_attention(q, lengths, *mine[r % copies],
                                                                   starts=starts, **kw))
    times = interleaved(calls, reps, rounds)
    row["sdpa_us"] = times["sdpa"]
    for name in variants:
        us = times[name]
        row[f"{name}_us"] = us
        row[f"{name}_tbps"] = read / us / 1e6
        row[f"{name}_rel_err"] = check(name, outs[name], ref, sdpa_out)
        row[f"{name}_kernel"] = info[name]
    caches.clear()
    mine.clear()
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", default="64,512,4096,32768")
    ap.add_argument("--tcap", type=int, default=0, help="cache capacity (default: context rounded up to 64)")
    ap.add_argument("--heads", default="32,4", help="query heads, KV heads")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--variants", default="default")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kernel-info", action="store_true", help="print registers, spills, shared memory")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "fp8"),
                    help="the cache our kernel reads (fp8: SDPA and the reference on its dequantized values)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attention_bf16.json"))
    args = ap.parse_args()
    hq, hkv = (int(x) for x in args.heads.split(","))
    variants = {name: parse_variant(name) for name in args.variants.split(",")}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    tune = attention.BF16_TUNE if args.kv == "bf16" else attention.FP8_TUNE
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tune": dict(tune), "rows": []}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    cols = ([f"{n} us" for n in variants] + [f"x SDPA ({n})" for n in variants]
            + [f"{n} TB/s" for n in variants])
    print(f"{out['gpu']}, torch {out['torch']}, Hq {hq}, Hkv {hkv}, D {args.d}; tune {out['tune']}")
    print("| batch | context | T_cap | splits | SDPA us | " + " | ".join(cols) + " |")
    print("|" + "---|" * (5 + len(cols)))
    for batch in (int(x) for x in args.batch.split(",")):
        for context in (int(x) for x in args.context.split(",")):
            t_cap = args.tcap or -(-context // 64) * 64
            if t_cap < context:
                raise SystemExit(f"--tcap {t_cap} < context {context}")
            row = run_shape(batch, context, t_cap, hq, hkv, args.d, variants, args.rounds, l2, args.kv)
            out["rows"].append(row)
            vals = ([f"{row[f'{n}_us']:.1f}" for n in variants]
                    + [f"{row['sdpa_us'] / row[f'{n}_us']:.2f}" for n in variants]
                    + [f"{row[f'{n}_tbps']:.2f}" for n in variants])
            print(f"| {batch} | {context} | {t_cap} | {row['splits_default']} | {row['sdpa_us']:.1f} | "
                  + " | ".join(vals) + " |", flush=True)
            if args.kernel_info:
                print("  " + "; ".join(f"{n}: {row[f'{n}_kernel']}" for n in variants), flush=True)
            with open(args.out, "w") as fh:  # after every row: a killed run keeps what it measured
                json.dump(out, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

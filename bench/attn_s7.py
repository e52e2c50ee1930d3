"""Device check + timing of the Gluon NVFP4 decode-attention kernel, seventh session, one process.

python3 bench/attn_s7.py [contexts]  (writes $OUT/attn_s7.json, or ./attn_s7.json without OUT)

The session's call compared three loops in one run (raw: bench/data/attn_s7_h200.json): the third
session's loop ("default" there, 120.5 us at 32K), per-lane pointers with unmasked full steps ("ptr",
105.5 us, bit-identical; now the only loop, fp4rl/kernels/attention/gluon_stream.py) and ptr with one
softmax update per 32 tokens ("ptr2", 105.6 us, not kept). This script now runs the kept kernel: attn9's
correctness cases (variable lengths, an empty sequence, left padding, 8 query heads per KV head, V
scales over 8 decades, ragged tails; rel err vs float32 SDPA on the dequantized cache, NaN, repeat
equality), then batch 8, 32/8 heads, d 128 at 4K / 32K / 128K against torch SDPA BF16, timed as in
attn9 (CUDA-graph replay over rotated operand copies), two interleaved rounds, the better kept.
"""

import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn9 import case_inputs, rel, timing_inputs  # noqa: E402

import fp4rl.benchmarks.gpu_kernels as gk  # noqa: E402
from fp4rl.kernels import attention as A  # noqa: E402
from fp4rl.kernels._common import ASM  # noqa: E402

VARIANTS = {"default": {}}  # one kernel now (see the docstring)
CASES = [
    dict(b=2, hq=32, hkv=8, t=4096, lengths=[4096, 1000], scale=1.0),
    dict(b=3, hq=16, hkv=4, t=1024, lengths=[1024, 17, 0], scale=1.0),  # short + empty sequence
    dict(b=2, hq=8, hkv=1, t=2048, lengths=[2048, 333], scale=30.0),  # G = 8, large q
    dict(b=2, hq=32, hkv=8, t=2048, lengths=[2048, 1500], starts=[100, 7], scale=1.0),  # left padding
    dict(b=1, hq=32, hkv=8, t=8192, lengths=[8192], scale=1.0, vscale_spread=True),
    dict(b=4, hq=32, hkv=8, t=3000, lengths=[3000, 2999, 130, 64], scale=1.0),  # ragged tails
]


def run_variant(name, fn):
    """fn(); restores the Triton ASM switch afterwards."""
    asm_on = ASM["on"]
    try:
        return fn()
    finally:
        ASM["on"] = asm_on


def check(res, bad):
    for ci, c in enumerate(CASES):
        check_case(res, bad, ci, c)


def check_case(res, bad, ci, c):
    hq, hkv = c["hq"], c["hkv"]
    q, lengths, starts, kq, vq, r = case_inputs(ci, c)

    def call():
        return A.decode_attention(q, lengths, kq[0], vq[0], kq[2], vq[2], k_scale=kq[1], v_scale=vq[1],
                                  starts=starts, kernel="gluon")

    outs = {}
    for name in VARIANTS:
        row = {"case": ci, "variant": name, **c}
        if name in bad:
            row["error"] = "skipped: " + bad[name][:200]
        else:
            try:
                o = run_variant(name, call)
                o2 = run_variant(name, call)
                torch.cuda.synchronize()
                outs[name] = o
                row.update(rel_err=rel(o, r), nan=bool(torch.isnan(o).any()),
                           repeat_equal=bool(torch.equal(o, o2)),
                           per_h=[rel(o[:, h::hq // hkv], r[:, h::hq // hkv]) for h in range(hq // hkv)])
                if 0 in c["lengths"]:
                    row["empty_zero"] = bool((o[c["lengths"].index(0)] == 0).all())
                if "default" in outs and name != "default":
                    row["rel_vs_default"] = rel(o, outs["default"].float())
                    row["equal_default"] = bool(torch.equal(o, outs["default"]))
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                row["error"] = repr(exc)[:400]
                bad[name] = row["error"]
        ok = "error" not in row and row["rel_err"] < 1e-2 and not row["nan"] and row["repeat_equal"] \
            and row.get("empty_zero", True)
        row["ok"] = bool(ok)
        print("check", json.dumps({k: v for k, v in row.items() if k != "per_h"}), flush=True)
        res["check"].append(row)


def bench(res, bw, contexts, bad):
    for t in contexts:
        t0 = time.time()
        bench_context(res, bw, t, bad)
        torch.cuda.empty_cache()
        print(f"[T={t}: {time.time() - t0:.0f}s]", flush=True)


def bench_context(res, bw, t, bad, rounds=2):
    b, hq, hkv, d = 8, 32, 8, 128
    x = timing_inputs(b, t, hq, hkv, d)
    q, q4, lengths, r4, bf16_sets, sets4 = x.q, x.q4, x.lengths, x.ref, x.bf16_sets, x.sets4
    base = {"context": t, "batch": b, "hq": hq, "hkv": hkv, "d": d,
            "floor_us": (x.fp4_bytes + 2 * q.nbytes) / bw * 1e6,
            "bf16_floor_us": (x.kv_bf16 + 2 * q.nbytes) / bw * 1e6}

    def call(s, q=q, lengths=lengths):
        (kd, ks, kg), (vd, vs, vg) = s
        return A.decode_attention(q, lengths, kd, vd, kg, vg, k_scale=ks, v_scale=vs, kernel="gluon")

    times = {}
    errs = {}
    out_default = None
    for name in VARIANTS:
        if name in bad:
            continue
        try:
            o = run_variant(name, lambda: call(sets4[0]))
            errs[name] = {"rel_err": rel(o, r4)}
            if name == "default":
                out_default = o
            elif out_default is not None:
                errs[name]["rel_vs_default"] = rel(o, out_default.float())
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            bad[name] = repr(exc)[:400]
    for _ in range(rounds):
        times.setdefault("sdpa_bf16", []).append(gk.time_calls(
            [lambda s=s: F.scaled_dot_product_attention(q4, s[0], s[1], enable_gqa=True)
             for s in bf16_sets], min_calls=8))
        for name in VARIANTS:
            if name in bad or name not in errs:
                continue
            try:
                us = run_variant(name, lambda: gk.time_calls([lambda s=s: call(s) for s in sets4],
                                                             min_calls=8))
                times.setdefault(name, []).append(us)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                bad[name] = repr(exc)[:400]
    us_sdpa = min(times["sdpa_bf16"])
    for name, ts in times.items():
        row = {**base, "config": name, "us": min(ts), "us_rounds": ts, "speedup": us_sdpa / min(ts),
               "sdpa_bf16_us": us_sdpa, **errs.get(name, {})}
        print("bench", json.dumps(row), flush=True)
        res["bench"].append(row)
    for name in VARIANTS:
        if name in bad and name not in times:
            res["bench"].append({**base, "config": name, "error": bad[name]})


def main():
    out_dir = os.environ.get("OUT", ".")
    path = os.path.join(out_dir, "attn_s7.json")
    contexts = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "4096,32768,131072").split(",")]
    res = {"env": gk._env(), "argv": sys.argv, "variants": VARIANTS, "check": [], "bench": []}
    gk.WARM_MS = 20.0  # steady clocks before each timing
    bad: dict[str, str] = {}
    t0 = time.time()
    try:
        check(res, bad)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    print(f"[check {time.time() - t0:.0f}s]", flush=True)
    bw = gk.copy_bandwidth()
    res["copy"] = bw
    print(f"copy {bw['tb_s']:.2f} TB/s", flush=True)
    try:
        bench(res, bw["tb_s"] * 1e12, contexts, bad)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    res["errors"] = bad
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print(f"[total {time.time() - t0:.0f}s] -> {path}\n")
    print("| context | config | us | x SDPA BF16 | SDPA us | floor us | rel err | rel vs default |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res["bench"]:
        if "us" in r:
            print(f"| {r['context']} | {r['config']} | {r['us']:.1f} | {r['speedup']:.2f} | "
                  f"{r['sdpa_bf16_us']:.1f} | {r['floor_us']:.1f} | {r.get('rel_err', float('nan')):.2e} | "
                  f"{r.get('rel_vs_default', float('nan')):.1e} |")
        else:
            print(f"| {r['context']} | {r['config']} | error: {r['error'][:80]} | | | | | |")
    print("\nchecks:", "all ok" if all(r["ok"] for r in res["check"]) else
          [(r["case"], r["variant"], r.get("rel_err", r.get("error"))) for r in res["check"] if not r["ok"]])
    for name, err in bad.items():
        print("error", name, err[:300])


if __name__ == "__main__":
    main()

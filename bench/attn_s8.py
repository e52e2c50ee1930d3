"""Eighth session: where the Gluon NVFP4 decode attention stands against its knobs, one process.

[BATCH=8] [HKV=8] python3 bench/attn_s8.py [context] [variant,...]  (variant: a name, or names joined by +)
(writes $OUT/attn_s8_<context>_b<batch>_h<hkv>.json)

Batch 8 (BATCH), 32 query heads over 8 KV heads (HKV), d 128 at one context (default 32768) against torch
SDPA BF16 in the same run: the default configuration, then variants of the dispatcher's knobs (splits,
warps per CTA, L2 prefetch distance, register cap) and the timing-only experiment modes of
fp4rl.kernels.attention.gluon_ptx (mode bit 1: no unpack, wrong values; it bounds what a cheaper unpack
can buy). Each variant's output is compared with the default's (bit-identical expected for every knob;
splits change the merge order). Timing as in attn_s7.py (CUDA-graph replay over rotated operand copies),
ROUNDS interleaved rounds (env, default 2), medians reported (SDPA too).
"""

import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn9 import rel, timing_inputs  # noqa: E402

import fp4rl.benchmarks.gpu_kernels as gk  # noqa: E402
from fp4rl.kernels import attention as A  # noqa: E402

VARIANTS = {  # _mode: gluon_ptx mode bits (default 20 = 16 vote + 4 two S chains)
    "default": {},
    "tile_max": {"_mode": 4},  # sessions 3-7: the tile maximum every step
    "no_unpack": {"_mode": 21},  # timing only: wrong values
    "no_unpack_tile_max": {"_mode": 5},  # timing only
    "rescale_always": {"_mode": 6},  # tile maximum, accumulators rescaled every step
    "one_chain": {"_mode": 16},
    "splits4": {"num_splits": 4}, "splits5": {"num_splits": 5}, "splits8": {"num_splits": 8},
    "splits12": {"num_splits": 12}, "splits2": {"num_splits": 2}, "splits3": {"num_splits": 3},
    "splits16": {"num_splits": 16}, "splits24": {"num_splits": 24}, "splits32": {"num_splits": 32},
    "splits48": {"num_splits": 48},
    "pf0": {"_pf": 0}, "pf2": {"_pf": 2}, "pf4": {"_pf": 4}, "pf6": {"_pf": 6},
    "warps2": {"num_warps": 2}, "warps8": {"num_warps": 8},
    "reg128": {"_maxnreg": 128}, "reg152": {"_maxnreg": 152}, "reg160": {"_maxnreg": 160},
    "nocap": {"_maxnreg": None},  # the registers ptxas picks (default: capped at 168, 12 warps / SM)
    "w2_reg144": {"num_warps": 2, "_maxnreg": 144}, "w2_reg128": {"num_warps": 2, "_maxnreg": 128},
    "no_stream": {"_dbg": 1}, "merge_one": {"_dbg": 2},  # timing only: no token loop / merge of one slot
    "counter1": {"_dbg": 8},  # one split through the split counter and its fence anyway (A/B)
    "warp_slots": {"_dbg": 16},  # every warp publishes its own partial (the fiftieth session's merge; A/B)
    # a CTA's warps merged in the CTA at every split count: the default since the fifty-first session (which
    # timed it as a variant: then the CTA merged only at one split by default); with FP4RL_GLUON_CTA_MERGE=1
    # in the environment, the variant against the one-split-only merge
    "cta_all": {"_dbg": 32},
    "step_quantum": {"_dbg": 64},  # a split's tokens in whole 64-token steps, not pairs (fifty-second; A/B)
}
ROUNDS = int(os.environ.get("ROUNDS", "2"))  # interleaved timing rounds
TIMING_ONLY = {"no_unpack", "no_stream", "merge_one", "no_unpack_tile_max"}


def knobs(name: str) -> dict:
    """A variant's knobs; "cta_all+splits16": both (DBG bits OR together)."""
    kw = {}
    for part in name.split("+"):
        for key, val in VARIANTS[part].items():
            kw[key] = kw.get(key, 0) | val if key == "_dbg" else val
    return kw


def main():
    out_dir = os.environ.get("OUT", ".")
    t = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(VARIANTS)
    if "default" not in names:
        names = ["default"] + names
    gk.WARM_MS = 20.0
    bw = gk.copy_bandwidth()
    print(f"copy {bw['tb_s']:.2f} TB/s", flush=True)
    b, hq, hkv, d = int(os.environ.get("BATCH", "8")), 32, int(os.environ.get("HKV", "8")), 128
    torch.manual_seed(0)
    x = timing_inputs(b, t, hq, hkv, d)
    q, q4, lengths, r4, bf16_sets, sets4 = x.q, x.q4, x.lengths, x.ref, x.bf16_sets, x.sets4
    floor = (x.fp4_bytes + 2 * q.nbytes) / (bw["tb_s"] * 1e12) * 1e6

    def call(s, kw):
        (kd, ks, kg), (vd, vs, vg) = s
        return A.decode_attention(q, lengths, kd, vd, kg, vg, k_scale=ks, v_scale=vs, kernel="gluon", **kw)

    rows, bad, times = {}, {}, {}
    out_default = None
    for name in names:
        kw = knobs(name)
        try:
            o = call(sets4[0], kw)
            torch.cuda.synchronize()
            rows[name] = {"rel_err": rel(o, r4), "nan": bool(torch.isnan(o).any())}
            if name == "default":
                out_default = o
            elif out_default is not None:
                rows[name]["equal_default"] = bool(torch.equal(o, out_default))
                rows[name]["rel_vs_default"] = rel(o, out_default.float())
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            bad[name] = repr(exc)[:300]
    for _ in range(ROUNDS):
        times.setdefault("sdpa_bf16", []).append(gk.time_calls(
            [lambda s=s: F.scaled_dot_product_attention(q4, s[0], s[1], enable_gqa=True) for s in bf16_sets],
            min_calls=8))
        for name in names:
            if name in bad:
                continue
            kw_name = knobs(name)
            try:
                times.setdefault(name, []).append(gk.time_calls(
                    [lambda s=s, kw=kw_name: call(s, kw) for s in sets4], min_calls=8))
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                bad[name] = repr(exc)[:300]
    sdpa = statistics.median(times["sdpa_bf16"])
    res = {"env": gk._env(), "argv": sys.argv, "copy": bw, "context": t, "floor_us": floor, "sdpa_us": sdpa,
           "variants": {n: knobs(n) for n in names}, "rows": [], "errors": bad}
    print(f"\ncontext {t}, batch {b}, {hq}/{hkv} heads: SDPA BF16 {sdpa:.1f} us, floor {floor:.1f} us\n")
    print(f"medians of {ROUNDS} interleaved rounds (min, max in brackets)")
    print("| variant | knobs | us | x SDPA | rel err | = default |")
    print("|---|---|---|---|---|---|")
    for name in names:
        if name not in times:
            print(f"| {name} | {knobs(name)} | error: {bad.get(name, '')[:80]} | | | |")
            continue
        us = statistics.median(times[name])
        row = {"variant": name, "us": us, "us_rounds": times[name], "speedup": sdpa / us,
               **rows.get(name, {})}
        res["rows"].append(row)
        eq = row.get("equal_default", "")
        note = " (timing only)" if name in TIMING_ONLY else ""
        lo, hi = min(times[name]), max(times[name])
        print(f"| {name}{note} | {knobs(name)} | {us:.1f} [{lo:.1f}, {hi:.1f}] | "
              f"{sdpa / us:.2f} | "
              f"{row.get('rel_err', 0):.2e} | {eq} |")
    with open(os.path.join(out_dir, f"attn_s8_{t}_b{b}_h{hkv}.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"[total {time.time() - t0:.0f}s]")

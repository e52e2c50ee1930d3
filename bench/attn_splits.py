"""Eighteenth session: the NVFP4 decode attention's context splits at rollout-sized contexts, one process.

CASES="b:hkv:t[:length],..." [SPLITS=2,4,...] [WARPS=4,2,...] [ROUNDS=2] python3 bench/attn_splits.py  (writes
$OUT/attn_splits$TAG.json; DBG=64: the kernel's splits in whole 64-token steps, A/B)

For each case (batch b, 32 query heads over hkv KV heads, d 128, every sequence at context t = the cache's
capacity, or at `length` tokens of a t-slot cache, as in the sampler mid-decode: the kernel cuts a
sequence's tokens into splits of whole 128-token blocks at 4 warps, so past a power of two fewer splits may
hold tokens than the grid has): the dispatcher's split count (`_splits_gluon`, what the sampler runs) and
each count of SPLITS,
timed as bench/attn_s8.py does (CUDA-graph replay over operand copies beyond the L2, ROUNDS interleaved
rounds, medians), each output checked against the float32 reference on the dequantized cache.
WARPS (forty-ninth session): warps a CTA besides 4 (the keys "n" for 4 warps, "n/w" for w warps), for the
wave check at batch 32-128, where 4-warp CTAs (three resident a multiprocessor) can run in more than one
wave; "auto": the dispatcher's splits and warps (`_warps_gluon`).
"""

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn9 import dq, ref_attn, rel, timing_inputs  # noqa: E402

import fp4rl.benchmarks.gpu_kernels as gk  # noqa: E402
from fp4rl.kernels import attention as A  # noqa: E402
from fp4rl.kernels.attention import gluon_decode  # noqa: E402

CASES = os.environ.get("CASES", "1:8:1024,1:8:2048,1:8:4096,1:8:8192,1:8:16384,1:4:1024,1:4:2048,1:4:4096,"
                                "1:4:8192,1:4:16384,8:4:1024,8:4:2048,8:4:4096,8:4:8192,8:4:16384,8:8:1024,"
                                "8:8:4096,32:8:1024,32:8:4096,32:4:1024,32:4:4096")
SPLITS = [int(s) for s in os.environ.get("SPLITS", "1,2,3,4,6,8,12,16,24,32").split(",")]
ROUNDS = int(os.environ.get("ROUNDS", "2"))
WARPS = [int(w) for w in os.environ.get("WARPS", "4").split(",")]
DBG = int(os.environ.get("DBG", "0"))  # the Gluon kernel's DBG bits, every call (64: splits in whole steps)
TAG = os.environ.get("TAG", "")  # the JSON's name: attn_splits{TAG}.json


def main():
    gk.WARM_MS = 20.0
    bw = gk.copy_bandwidth()
    print(f"copy {bw['tb_s']:.2f} TB/s", flush=True)
    res = {"env": gk._env(), "copy": bw, "dbg": DBG, "cases": []}
    for case in CASES.split(","):
        b, hkv, t, *ln = (int(v) for v in case.split(":"))
        torch.manual_seed(0)
        x = timing_inputs(b, t, 32, hkv, 128)
        if ln:  # every sequence at ln[0] tokens of the t-slot cache (as the sampler mid-decode), not full
            if not 0 <= ln[0] <= t:
                raise ValueError(f"case {case}: the length must be within the cache's {t} slots")
            x.lengths.fill_(ln[0])
            x.ref = ref_attn(x.q, dq(x.kq, 128), dq(x.vq, 128), x.lengths)
        merged = gluon_decode.cta_merge_every_split(DBG)
        chosen = A._splits_gluon(b, hkv, t, 4, x.q.device, 168, 32 // hkv, merged)
        rule1 = A._splits_gluon(b, hkv, t, 4, x.q.device, 168, 32 // hkv, False)  # rule 1's count, for A/B
        floor = (x.fp4_bytes * int(x.lengths[0]) / t + 2 * x.q.nbytes) / (bw["tb_s"] * 1e12) * 1e6

        def call(s, n, x=x):
            n, w = n if isinstance(n, tuple) else (None, None) if n == "auto" else (n, 4)
            (kd, ks, kg), (vd, vs, vg) = s
            return A.decode_attention(x.q, x.lengths, kd, vd, kg, vg, k_scale=ks, v_scale=vs, kernel="gluon",
                                      num_splits=n, num_warps=w, _dbg=DBG)

        splits = sorted({n for n in SPLITS if t // (n * 4) >= 16} | {chosen, rule1})
        splits += [(n, w) for w in WARPS if w != 4 for n in SPLITS if t // (n * w) >= 16] + ["auto"]
        errs = {n: rel(call(x.sets4[0], n), x.ref) for n in splits}
        times = {n: [] for n in splits}
        for _ in range(ROUNDS):
            for n in splits:
                times[n].append(gk.time_calls([lambda s=s, n=n: call(s, n) for s in x.sets4], min_calls=8))
        us = {n: statistics.median(v) for n, v in times.items()}
        us = {(f"{n[0]}/{n[1]}" if isinstance(n, tuple) else n): v for n, v in us.items()}
        errs = {(f"{n[0]}/{n[1]}" if isinstance(n, tuple) else n): v for n, v in errs.items()}
        best = min(us, key=us.get)
        row = {"b": b, "hkv": hkv, "t": t, "length": int(x.lengths[0]), "chosen": chosen, "rule1": rule1,
               "best": best, "floor_us": floor, "us": us, "rel_err": errs}
        res["cases"].append(row)
        print(f"b {b:3d} hkv {hkv} t {t:5d} len {row['length']:5d}: chosen {chosen:2d} {us[chosen]:6.1f} us "
              f"(rule 1: {rule1:2d} {us[rule1]:6.1f}), "
              f"best {best!s:>4} {us[best]:6.1f} us (floor {floor:.1f}) | "
              + " ".join(f"{n}:{v:.1f}" for n, v in us.items()), flush=True)
        assert max(errs.values()) < 5e-3, errs
        torch.cuda.empty_cache()
        # written after each case: a timeout keeps the cases done
        with open(os.path.join(os.environ.get("OUT", "."), f"attn_splits{TAG}.json"), "w") as fh:
            json.dump(res, fh, indent=1, default=str)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"[total {time.time() - t0:.0f}s]")

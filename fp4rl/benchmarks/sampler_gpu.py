"""`fp4rl bench sampler_gpu`: decode tokens/s of the fp4rl Sampler on one GPU, random-weight models
of real shapes (Qwen3-8B, Qwen3-30B-A3B), by precision preset, KV cache and batch.

One engine for every row: `Sampler(..., device="cuda", dtype=bfloat16)`, i.e. the kernel path of
fp4rl/gpu_decode.py (Triton W4A16/W4A4 GEMMs, grouped experts, decode attention over FP8/NVFP4
caches, BF16 weights on cuBLAS, a CUDA graph per decode batch bucket). Each row: P = batch random
prompts of `--prompt` tokens, n = 1, temperature 1 (multinomial sampling on the host side of the
graph, as in RL), no EOS, so every row decodes the same number of tokens.

decode tok/s = batch / the decode cadence: the sampler's step clock (Sampler.step_clock) stamps the moment
each step's tokens reach the host; the cadence of one generate is the mean interval over its steps after the
first CLOCK_SKIP, and a row's figure the median over --repeats generates of N2 new tokens (after a warm-up
call that compiles, tunes and captures). Sampling, the host's per-step work and its sync stay in; prefill and
setup stay out. (Until the thirteenth session the figure was batch * (N2 - N1) / median(t(N2) - t(N1)) over
whole generates: a 48-layer model's generate wall time scattered by +-40 ms, which at batch 1 read steps from
0.6 to 4 ms around a 2.4 ms replay; that figure is still reported, as `wall_tok_s`.) A row whose step reads
below 0.95x its own graph replay, or whose generates' cadences differ by more than 10%, is marked noisy
(* after tok/s; `noisy`). `graph us` is one replay of the captured
decode step alone (CUDA events): the GPU time of a step without sampling or host work.

Speed-up limits beside each ratio: weight bytes a decode step must read in BF16 over those of the
preset (NVFP4 0.5625 B/param, BF16 2; routed experts scaled by the expected fraction of experts
that batch tokens touch under uniform routing, 1 - (1 - k/E)^batch; KV bytes ignored: short
context), computed from the built model at the benchmarked depth and at the shape's full depth
(MISSION.md's figures are the latter). The step-time split comes from torch.profiler over a few
sampler steps (CUDA kernels by family, and wall time per step).

`--fusion on,off` measures every row with the engine's fused decode step (fp4rl.kernels.fused: add +
RMSNorm, q/k-norm + RoPE + KV write, SiLU * up, W4A4 activations quantized by those kernels) and with
the module step, on the same sampler (the graphs are recaptured in between); each row's `vs BF16` is
against BF16 with the same setting. `--pdl on,off` likewise: programmatic dependent launch between the
step's kernels (fp4rl.kernels.pdl; the graphs are recaptured when it changes).

GPU memory (CUDA): each build records the GiB allocated after it and its peak (`gpu_gib`, `gpu_peak_gib`),
each row its own peak (warm-up, capture, the generates) and what stays allocated after it.
"""

from __future__ import annotations

import gc
import json
import time
import traceback

import torch
from torch import nn

from fp4rl.benchmarks import int_at_least, int_list_at_least
from fp4rl.benchmarks.decode_timing import (
    CLOCK_SKIP,
    _clocked,
    _median,
    _sync,
    graph_check,
    host_split,
    profile_split,
    replay_us,
    timed_generate,
)
from fp4rl.benchmarks.sampler_gpu_report import markdown, noisy
from fp4rl.kvcache import KV_CACHE_KINDS

SHAPES = {
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, qk_norm=True),
    # the dense Qwen3s around the 8B (the narrow GEMM rules were fitted on the 8B's shapes; these test them)
    "qwen3-4b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, qk_norm=True,
                     tie_word_embeddings=True),
    "qwen3-14b": dict(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=17408,
                      num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=40960, rope_theta=1000000.0, qk_norm=True),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          max_position_embeddings=40960, rope_theta=1000000.0, qk_norm=True, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    "tiny": dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=96,  # smoke test
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 max_position_embeddings=512, qk_norm=True, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, norm_topk_prob=True),
}
# (label, preset, bf16_last_fraction): all-linears W4A16, and the recipe preset with its BF16 last layers
_DENSE_PRECISIONS = [("bf16", "bf16", 0.15), ("nvfp4-w4a16 all linears", "nvfp4-w4a16", 0.0),
                     ("nvfp4-linear W4A4, last 15% BF16", "nvfp4-linear", 0.15)]
PRECISIONS = {
    "qwen3-8b": _DENSE_PRECISIONS,
    "qwen3-4b": _DENSE_PRECISIONS,
    "qwen3-14b": _DENSE_PRECISIONS,
    "qwen3-30b-a3b": [("bf16", "bf16", 0.15), ("nvfp4-w4a16 all linears", "nvfp4-w4a16", 0.0),
                      ("nvfp4-experts W4A4, last 15% BF16", "nvfp4-experts", 0.15)],
    "tiny": [("bf16", "bf16", 0.15), ("nvfp4-w4a16 all linears", "nvfp4-w4a16", 0.0),
             ("nvfp4-experts W4A4, last 15% BF16", "nvfp4-experts", 0.15)],
}


def add_arguments(parser):
    parser.add_argument("--shapes", default="qwen3-8b:36,qwen3-30b-a3b:12",
                        help="comma-separated SHAPE:LAYERS (decoder layers built; time is linear in layers)")
    parser.add_argument("--batch", type=int_list_at_least(1), default="1,8,32",
                        help="batch sizes (prompts, n=1)")
    parser.add_argument("--kv", default="bf16,nvfp4,fp8", help="KV caches")
    parser.add_argument("--prompt", type=int_at_least(1), default=128, help="prompt tokens")
    parser.add_argument("--tokens", default="8,56", help="N1,N2 new tokens of the two timed generates")
    parser.add_argument("--repeats", type=int_at_least(1), default=3,
                        help="timed (N1, N2) pairs (the median cadence is kept)")
    parser.add_argument("--tune", action="store_true", help="time every GEMM candidate per shape (compiles "
                        "~20 Triton configurations per shape and batch bucket); default: first candidate")
    parser.add_argument("--profile-batch", type=int_list_at_least(1, empty_ok=True), default="1,32",
                        help="batches profiled, '' for none")
    parser.add_argument("--profile-kv", default="bf16",
                        help="KV cache formats whose rows are profiled (bf16, nvfp4, fp8)")
    parser.add_argument("--presets", default="", help="comma-separated precision presets to measure (bf16, "
                        "nvfp4-w4a16, nvfp4-linear, nvfp4-experts); default: every row of the shape")
    parser.add_argument("--w4a16-last", default="0", help="comma-separated BF16 last-layer fractions of "
                        "the nvfp4-w4a16 arm, one row each (default 0: every linear W4A16; 0.15: the "
                        "recipe's BF16 last layers, 7 of 48)")
    parser.add_argument("--lm-head", default="bf16", help="comma-separated precisions of the lm_head in "
                        "the NVFP4 arms, one row each: 'bf16' (every preset's choice) or 'w4a16' (a contract "
                        "rule ('lm_head', 'w4a16'): the head's 151936 x H weight read as NVFP4, 3.6x fewer "
                        "bytes)")
    parser.add_argument("--dense-rows", default="0", help="comma-separated Sampler(dense_rows=) settings of "
                        "the NVFP4 arms, one row each: calls of at least that many rows run cuBLAS on a "
                        "DQ(W) copy (0: the 4-bit kernels at every batch)")
    parser.add_argument("--host-batch", type=int_list_at_least(1, empty_ok=True), default="",
                        help="batches whose host time per step is split "
                        "(host_split: graph launch cost, host-only step, top CPU ops), '' for none")
    parser.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    parser.add_argument("--pdl", default="on", help="comma-separated settings of programmatic dependent "
                        "launch between the decode step's kernels (fp4rl.kernels.pdl), each row measured "
                        "with each: 'on' (the default kinds), 'all' (every kind), 'off', or 'no-KIND[+KIND]' "
                        "(every kind except those: gemv, mma, wide, grouped, triton, attn)")
    parser.add_argument("--k-split", default="default", help="comma-separated settings of where the CUDA "
                        "GEMM splits K at one row and for the routed experts (fp4rl.kernels.gemv_cuda."
                        "in_cta_split), each row measured with each: 'cta' (warps of a CTA), 'cluster' (CTAs "
                        "of a cluster) or 'default' (FP4RL_MMA16_KW's choice); the same bits either way")
    parser.add_argument("--kv-write", default="default", help="comma-separated settings of how the fused "
                        "step writes an NVFP4 KV cache (fp4rl.gpu_decode.FUSED_KV_FP4), each nvfp4-KV row "
                        "measured with each: 'fused' (in the q/k-norm + RoPE kernel), 'separate' (store_kv's "
                        "quantize and writes) or 'default' (FP4RL_FUSED_KV's choice); the same bytes")
    parser.add_argument("--fusion", default="on", help="'on', 'off' or 'on,off': the engine's fused decode "
                        "step (fp4rl.kernels.fused) or the module step, each row measured with each")
    parser.add_argument("--offload-trainer", default="auto", choices=("auto", "on", "off"),
                        help="move the trainer's BF16 weights to host memory while a sampler is built "
                        "and measured (the BF16 sampler copies each tensor to the GPU; an NVFP4 one "
                        "quantizes each weight on the GPU, a weight at a time); auto: when two BF16 copies "
                        "would not fit the free GPU memory (a full-depth Qwen3-30B-A3B: 2 x 61 GB on an 80 GB"
                        " card); on: always (long contexts at large batch: room for the KV cache)")
    parser.add_argument("--mma16-stamps", action="store_true", help="diagnostics: the CUDA mma16 GEMMs stamp "
                        "their CTAs' progress in the graph (fp4rl.benchmarks.stamps), reported with each "
                        "profiled row ('stamps'); slows them a little, so time the rows without it")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="JSON results (rewritten after every row)")


# ----------------------------------------------------------------------------------------------
# models and byte counts


def build_trainer(cfg: dict, layers: int, device) -> nn.Module:
    """A random BF16 CausalLM of the shape (weights N(0, 0.02), norms 1), built on the device."""
    from fp4rl.model import CausalLM, ModelConfig, rope_inv_freq

    config = ModelConfig(**{**cfg, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = CausalLM(config).to(torch.bfloat16)
    model = model.to_empty(device=device)
    model.model.rope_inv_freq = rope_inv_freq(config)
    g = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=g)
    model.tie_weights()
    return model.eval()


def expert_fraction(config, batch: int) -> float:
    """Expected fraction of a layer's experts that `batch` tokens route to (uniform top-k)."""
    if not config.num_experts:
        return 1.0
    return 1.0 - (1.0 - config.num_experts_per_tok / config.num_experts) ** batch


def _packed(m: nn.Module) -> bool:
    from fp4rl.packed import PackedNVFP4Linear

    return isinstance(m, PackedNVFP4Linear)


def layer_bytes(layer: nn.Module, frac: float, force_bf16: bool = False) -> float:
    """Weight bytes one decode step reads from a decoder layer (packed 0.5625 B/param, else 2): the NVFP4
    format's floor; the CUDA mma16 kernels read their re-laid copy, 0.625 B/param (bf16 block scales)."""
    from fp4rl.packed import PackedNVFP4Linear

    total = 0.0
    for name, m in layer.named_modules():
        if isinstance(m, PackedNVFP4Linear):
            b = m.in_features * m.out_features * (2.0 if force_bf16 else 0.5625)
        elif isinstance(m, nn.Linear):
            b = m.in_features * m.out_features * 2.0
        else:
            continue
        total += b * (frac if "experts." in name else 1.0)
    return total


def step_bytes(sampler, contract, full_layers: int, batch: int) -> dict:
    """Weight bytes per decode step at the built depth and at full depth (same per-layer layout)."""
    m, cfg = sampler.model, sampler.config
    frac = expert_fraction(cfg, batch)
    head = m.lm_head.in_features * m.lm_head.out_features * (0.5625 if _packed(m.lm_head) else 2.0)
    built = head + sum(layer_bytes(layer, frac) for layer in m.model.layers)
    n_bf16 = full_layers if contract.preset == "bf16" else len(contract.bf16_last_layers(full_layers))
    first = m.model.layers[0]
    full = head + (full_layers - n_bf16) * layer_bytes(first, frac) + n_bf16 * layer_bytes(first, frac, True)
    return {"built": built, "full": full}


# ----------------------------------------------------------------------------------------------
# main


def copy_bandwidth(device) -> float:
    """Device copy bytes (read + write) per second through an SM kernel, 1 GiB, best of 5."""
    x = torch.ones(1 << 29, dtype=torch.float16, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(6):
        _sync(device)
        t = time.perf_counter()
        torch.mul(x, 1.0, out=y)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    del x, y
    return 2 * (1 << 30) / best


def measure_row(sampler, contract, row: dict, prompts, args, env, results, base) -> None:
    """Time one (precision, KV, batch) row into `row` (see the module docstring)."""
    n1, n2 = (int(v) for v in args.tokens.split(","))
    batch, shape = row["batch"], row["shape"]
    t_warm = timed_generate(sampler, prompts, 4)  # compiles, tunes, captures this bucket's graph
    # the cadence of each N2 generate (the figure) and, for comparison with earlier sessions, the difference
    # of back-to-back (N1, N2) generates' wall times (noisy: prefill and setup scatter by tens of ms)
    diffs, cadence = [], []
    for _ in range(args.repeats):
        t1 = timed_generate(sampler, prompts, n1)
        t2, per_step = _clocked(sampler, prompts, n2)
        diffs.append(t2 - t1)
        cadence.append(per_step)
    wall = _median(sorted(diffs)) / (n2 - n1)
    step = _median(sorted(cadence))  # s per decode step
    tok_s = batch / step
    nbytes = step_bytes(sampler, contract, row["full_layers"], batch)
    key = (batch, row.get("fused", False), row.get("pdl", True))
    if contract.preset == "bf16":
        results.setdefault("bf16_bytes", {})[f"{shape}/{batch}"] = nbytes
        if row["kv"] == "bf16":
            base[key] = tok_s
    row.update(tok_s=tok_s, step_ms=step * 1e3, wall_step_ms=wall * 1e3, wall_tok_s=batch / wall,
               cadence_ms=[c * 1e3 for c in cadence], warm_s=t_warm, pair_diffs_s=diffs,
               graph_us=replay_us(sampler, batch), bytes_built=nbytes["built"], bytes_full=nbytes["full"],
               graph_error=sampler.engine.graph_error, counts=dict(sampler.engine.counts))
    row["noisy"] = noisy(row["step_ms"], row["graph_us"], row["cadence_ms"])
    ref = results.get("bf16_bytes", {}).get(f"{shape}/{batch}")
    if ref:
        row["limit_built"] = ref["built"] / nbytes["built"]
        row["limit_full"] = ref["full"] / nbytes["full"]
    if key in base:
        row["vs_bf16"] = tok_s / base[key]
    if env["copy_bw"]:
        row["floor_tok_s"] = batch * env["copy_bw"] / nbytes["built"]
    row.update(gpu_memory(sampler.device))


def gpu_memory(device) -> dict:
    """{'gpu_gib': GiB allocated now, 'gpu_peak_gib': the peak since the last call} on CUDA ({} elsewhere);
    starts the next peak."""
    if device.type != "cuda":
        return {}
    out = {"gpu_gib": torch.cuda.memory_allocated(device) / 2**30,
           "gpu_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    torch.cuda.reset_peak_memory_stats(device)
    return out


def measure_precision(trainer, shape, layers, full_layers, label, preset, frac, args, env, results, base,
                      lm_head: str = "bf16", dense_rows: int = 0, restore: bool = True):
    """Every (KV, batch) row of one precision preset, plus its graph check and profiles; lm_head 'w4a16':
    with the rule ('lm_head', 'w4a16') added to the preset. restore: a trainer moved to host memory goes
    back to the GPU afterwards (False for the shape's last arm: the trainer is dropped next, and a full-depth
    30B's 57 GiB would cross PCIe for nothing)."""
    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import convert

    device = torch.device(args.device)
    rules = (("lm_head", lm_head),) if lm_head != "bf16" else ()
    contract = PrecisionContract(preset, bf16_last_fraction=frac, rules=rules)
    convert(trainer, contract)
    offload = device.type == "cuda" and offload_wanted(trainer, args.offload_trainer, device)
    if offload:  # the sampler copies (BF16) or quantizes (NVFP4) every weight on the GPU itself
        trainer.to("cpu")
        torch.cuda.empty_cache()
    try:
        yield from _measure(trainer, contract, shape, layers, full_layers, label, preset, frac, args, env,
                            results, base, offload, dense_rows)
    except BaseException as exc:  # the traceback's frames hold the sampler's tensors: free them first
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        gc.collect()
        if device.type == "cuda" and restore:  # back on the GPU if it was moved: a no-op if not
            torch.cuda.empty_cache()
            trainer.to(device)


def offload_wanted(trainer: nn.Module, mode: str, device) -> bool:
    """Whether to move the trainer to host memory while a sampler is built and measured
    (--offload-trainer)."""
    if mode != "auto":
        return mode == "on"
    tensors = {t.data_ptr(): t for t in [*trainer.parameters(), *trainer.buffers()]}  # tied weights once
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    free, _ = torch.cuda.mem_get_info(device)
    return 2 * nbytes > free  # the sampler's copy peaks above one more copy (stacking the experts)


def _measure(trainer, contract, shape, layers, full_layers, label, preset, frac, args, env, results, base,
             offload, dense_rows=0):
    from fp4rl.sampler import Sampler

    device = torch.device(args.device)
    batches = [int(b) for b in args.batch.split(",")]
    kvs = args.kv.split(",")
    n2 = int(args.tokens.split(",")[1])
    prof_batches = [int(b) for b in args.profile_batch.split(",") if b]
    prof_kvs = [k for k in args.profile_kv.split(",") if k]
    host_batches = [int(b) for b in args.host_batch.split(",") if b]
    check_kv = "nvfp4" if "nvfp4" in kvs else kvs[-1]
    gpu_memory(device)  # the build's peak from here
    t0 = time.perf_counter()
    sampler = Sampler(trainer, device=device, dtype=torch.bfloat16, eos_token_ids=[],
                      max_seq_len=args.prompt + n2 + 8, kernels=True, cuda_graphs=not args.no_graphs,
                      dense_rows=dense_rows)
    if not offload and device.type == "cuda":
        from fp4rl.qat import invalidate

        invalidate(trainer)  # the trainer's cached Q(W) (the sampler has its copy): free for later builds
    mem = sampler.memory()
    results["builds"].append({"shape": shape, "precision": label, "build_s": time.perf_counter() - t0,
                              "packed_vs_bf16": mem["packed_vs_bf16"], "packed_bytes": mem["packed_bytes"],
                              "dense_rows": dense_rows, "dense_copy_bytes": mem["dense_copy_bytes"],
                              "trainer_offloaded": "before the build" if offload else False,
                              **gpu_memory(device)})
    from fp4rl.kernels import pdl

    fusions = [f == "on" for f in args.fusion.split(",")]
    from fp4rl.kernels import gemv_cuda

    pdls = [pdl_setting(p) for p in args.pdl.split(",")]
    splits = [split_setting(s) for s in args.k_split.split(",")]
    writes = [kv_write_setting(w) for w in args.kv_write.split(",")]
    from fp4rl import gpu_decode

    for kv, fusion, (use_pdl, off), in_cta, fkv, batch in (
            (c, f, p, s, w, b) for c in kvs for f in fusions for p in pdls for s in splits
            for w in (writes if c == "nvfp4" else writes[:1]) for b in batches):
        sampler.kv_cache = kv
        if sampler.engine is not None:
            sampler.engine.set_fused(fusion)
            if (pdl.is_enabled() != use_pdl or pdl.kinds_off() != off or in_cta != gemv_cuda.IN_CTA_SPLIT
                    or fkv != gpu_decode.FUSED_KV_FP4):
                pdl.set_enabled(use_pdl)
                pdl.set_kinds_off(off)
                gemv_cuda.set_in_cta_split(in_cta)
                gpu_decode.FUSED_KV_FP4 = fkv
                sampler.engine.reset_graphs()
        fused = bool(sampler.engine is not None and sampler.engine.fused)
        head = {"shape": shape, "precision": label, "fused": fused,
                "pdl": bool(sampler.engine is not None and pdl.enabled(device))}
        if args.mma16_stamps and device.type == "cuda":
            head["mma16_stamps"] = True
        if head["pdl"]:
            head["pdl_off"] = sorted(off)
        if len(splits) > 1 or not in_cta:
            head["k_split"] = "cta" if in_cta else "cluster"
        if kv == "nvfp4" and (len(writes) > 1 or not fkv):
            head["kv_write"] = "fused" if fkv else "separate"
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, trainer.config.vocab_size, (batch, args.prompt), generator=g).tolist()
        row = {**head, "layers": layers, "full_layers": full_layers, "preset": preset,
               "bf16_last_fraction": frac, "kv": kv, "batch": batch}
        try:
            measure_row(sampler, contract, row, prompts, args, env, results, base)
        except Exception as exc:  # noqa: BLE001 - record and go on with the next row
            row["error"] = repr(exc)[:400]
        results["rows"].append(row)
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "counts"}
        print(json.dumps(shown), flush=True)
        if kv == check_kv and batch == batches[min(1, len(batches) - 1)]:
            try:
                check = graph_check(sampler, prompts)
                results["checks"].append({**head, "kv": kv, "batch": batch, **check})
            except Exception as exc:  # noqa: BLE001
                results["checks"].append({**head, "error": repr(exc)[:300]})
            print(json.dumps(results["checks"][-1]), flush=True)
        if kv in prof_kvs and batch in prof_batches and device.type == "cuda":
            try:
                split = profile_split(sampler, batch)
                if args.mma16_stamps:
                    from fp4rl.benchmarks import stamps

                    raw = stamps.records_path(args.out, shape, label, batch) if args.out else None
                    split["stamps"] = stamps.replay(sampler, batch, records_path=raw)
                results["profiles"].append({**head, "kv": kv, "batch": batch, **split})
            except Exception as exc:  # noqa: BLE001
                results["profiles"].append({**head, "batch": batch, "error": repr(exc)[:300]})
            print(json.dumps(results["profiles"][-1]), flush=True)
        if batch in host_batches and sampler.engine is not None and sampler.engine.graphs:
            try:
                split = host_split(sampler, prompts, *(int(v) for v in args.tokens.split(",")))
            except Exception as exc:  # noqa: BLE001
                split = {"error": repr(exc)[:300]}
            results.setdefault("hosts", []).append({**head, "kv": kv, "batch": batch, **split})
            print(json.dumps(results["hosts"][-1]), flush=True)
        yield


def run(args) -> int:
    from fp4rl import gpu_linear

    if args.repeats < 1:
        raise SystemExit(f"sampler_gpu: --repeats must be >= 1 (timed (N1, N2) pairs), got {args.repeats}")
    try:
        n1, n2 = (int(v) for v in args.tokens.split(","))
    except ValueError:
        raise SystemExit(f"sampler_gpu: --tokens must be N1,N2 (two integers), got {args.tokens!r}") from None
    if not 1 <= n1 < n2 or n2 < CLOCK_SKIP + 2:
        raise SystemExit(f"sampler_gpu: --tokens {args.tokens}: need 1 <= N1 < N2 and N2 >= {CLOCK_SKIP + 2} "
                         f"(the cadence skips the first {CLOCK_SKIP} steps and needs two more)")
    try:
        [pdl_setting(p) for p in args.pdl.split(",")]
        [split_setting(s) for s in args.k_split.split(",")]
        [kv_write_setting(w) for w in args.kv_write.split(",")]
        heads = lm_head_settings(args.lm_head)
        dense = [int(d) for d in args.dense_rows.split(",")]
        if any(d < 0 for d in dense):
            raise ValueError(f"--dense-rows {args.dense_rows!r}: integers >= 0")
        bad = [k for k in args.profile_kv.split(",") if k and k not in KV_CACHE_KINDS]
        if bad:
            raise ValueError(f"--profile-kv item {bad[0]!r}: use KV formats among {KV_CACHE_KINDS}")
    except ValueError as exc:
        raise SystemExit(f"sampler_gpu: {exc}") from None

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("sampler_gpu needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1 for a smoke test)")
        return 1
    gpu_linear.TUNE = args.tune
    if args.mma16_stamps and device.type == "cuda":
        from fp4rl.benchmarks import stamps

        stamps.enable(device)
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "cuda": torch.version.cuda, "tune": args.tune, "graphs": not args.no_graphs,
           "prompt": args.prompt, "tokens": args.tokens, "fusion": args.fusion, "pdl": args.pdl,
           "k_split": args.k_split, "kv_write": args.kv_write, "lm_head": args.lm_head,
           "mma16_stamps": args.mma16_stamps}
    env["copy_bw"] = copy_bandwidth(device) if device.type == "cuda" else None
    results = {"env": env, "rows": [], "profiles": [], "checks": [], "builds": [], "errors": []}

    def save():
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(results, fh, indent=1)

    print(json.dumps(env), flush=True)
    t_start = time.perf_counter()
    for spec in args.shapes.split(","):
        shape, _, layers = spec.partition(":")
        full_layers = SHAPES[shape]["num_hidden_layers"]
        layers = int(layers or full_layers)
        base: dict[tuple, float] = {}  # BF16 weights + BF16 KV tokens/s per (batch, fused), this run
        try:
            trainer = build_trainer(SHAPES[shape], layers, device)
        except Exception as exc:  # noqa: BLE001
            results["errors"].append({"shape": shape, "stage": "build", "error": repr(exc)[:400]})
            save()
            continue
        wanted = [w for w in args.presets.split(",") if w]
        rows = []
        for label, preset, frac in PRECISIONS[shape]:
            if preset == "nvfp4-w4a16":
                arms = [(label if float(f) == 0 else f"nvfp4-w4a16, last {float(f):.0%} BF16", preset,
                         float(f)) for f in args.w4a16_last.split(",")]
            else:
                arms = [(label, preset, frac)]
            for arm in arms:  # the NVFP4 arms once per --lm-head and --dense-rows choice, BF16 once
                rows += [(*arm, "bf16", 0)] if preset == "bf16" else \
                    [(arm[0] + ("" if h == "bf16" else f", lm_head {h.upper()}")
                      + (f", dense copy >= {d} rows" if d else ""), *arm[1:], h, d)
                     for h in heads for d in dense]
        rows = [r for r in rows if not wanted or r[1] in wanted]
        for i, (label, preset, frac, head, dense_rows) in enumerate(rows):
            try:
                for _ in measure_precision(trainer, shape, layers, full_layers, label, preset, frac, args,
                                           env, results, base, lm_head=head, dense_rows=dense_rows,
                                           restore=i < len(rows) - 1):
                    save()
            except Exception as exc:  # noqa: BLE001
                results["errors"].append({"shape": shape, "precision": label, "error": repr(exc)[:400]})
                print(json.dumps(results["errors"][-1]), flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del trainer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    env["total_s"] = time.perf_counter() - t_start
    save()
    print(markdown(results))
    return 0






def lm_head_settings(text: str) -> list[str]:
    """--lm-head -> the lm_head precisions of the NVFP4 arms ('bf16', 'w4a16'), in order, each once."""
    heads = [h.strip() for h in text.split(",") if h.strip()]
    bad = [h for h in heads if h not in ("bf16", "w4a16")]
    if bad or not heads:
        raise ValueError(f"--lm-head {text!r}: use a comma-separated list of 'bf16' and 'w4a16'")
    return list(dict.fromkeys(heads))


def kv_write_setting(text: str) -> bool:
    """--kv-write item -> whether the fused step writes an NVFP4 KV cache in its RoPE kernel
    (gpu_decode.FUSED_KV_FP4): 'fused', 'separate', or 'default' (FP4RL_FUSED_KV's choice)."""
    from fp4rl import gpu_decode

    if text in ("fused", "separate", "default"):
        return gpu_decode.FUSED_KV_FP4 if text == "default" else text == "fused"
    raise ValueError(f"--kv-write item {text!r}: use 'fused', 'separate' or 'default'")


def split_setting(text: str) -> bool:
    """--k-split item -> whether the CUDA GEMM splits K inside the CTA (gemv_cuda.in_cta_split): 'cta',
    'cluster', or 'default' (FP4RL_MMA16_KW's choice)."""
    from fp4rl.kernels import gemv_cuda

    if text in ("cta", "cluster", "default"):
        return gemv_cuda.IN_CTA_SPLIT if text == "default" else text == "cta"
    raise ValueError(f"--k-split item {text!r}: use 'cta', 'cluster' or 'default'")


def pdl_setting(text: str) -> tuple[bool, frozenset]:
    """--pdl item -> (PDL on, kinds without it): 'on' (the kinds FP4RL_PDL_OFF names, else pdl.DEFAULT_OFF),
    'all', 'off', 'no-wide+triton'."""
    from fp4rl.kernels import pdl

    if text in ("on", "off", "all"):
        return text != "off", pdl.env_kinds_off() if text == "on" else frozenset()
    if text.startswith("no-"):
        kinds = frozenset(text[3:].split("+"))
        if kinds and not kinds - set(pdl.KINDS):
            return True, kinds
    raise ValueError(f"--pdl item {text!r}: use 'on', 'all', 'off' or 'no-KIND[+KIND]', kinds {pdl.KINDS}")


if __name__ == "__main__":
    import argparse
    import sys

    _parser = argparse.ArgumentParser(prog="python -m fp4rl.benchmarks.sampler_gpu")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))

"""Timing and profiling of the fp4rl Sampler's decode on a GPU, for `fp4rl bench sampler_gpu`: whole-generate
wall time, the decode cadence from the sampler's step clock, one graph replay (CUDA events), the graph vs
eager check, the CUDA kernel split of a decode step by kernel family (torch.profiler), and the host's share
of a step (host_split). Separate from sampler_gpu.py, which builds the models, counts the bytes and drives
the rows.
"""

from __future__ import annotations

import time

import torch

CATEGORIES = [  # kernel name fragments (lower case), first match wins
    ("nvfp4 GEMM (Triton, Gluon, CUDA mma16)", ("w4_gemm", "_gemv_mma", "w4a16_mma16")),
    ("dequantize (Triton)", ("_dequantize_kernel",)),
    ("quantize (Triton)", ("_quantize_kernel", "_amax_kernel", "_quantize_rows", "_quantize_flat")),
    ("fused norm / rope / silu (Triton)", ("_add_rmsnorm", "_qk_norm_rope", "_silu_mul")),
    ("decode attention (Triton)", ("_decode_attn",)),
    ("SDPA (BF16 KV)", ("fmha", "flash", "attention", "efficient")),
    ("BF16 GEMM (cuBLAS, grouped_mm)", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk",
                                        "grouped")),
    ("sort / index / scatter", ("sort", "radix", "scan", "index", "gather", "scatter", "bitonic", "search")),
    ("softmax / sampling / top-k", ("softmax", "multinomial", "distribution", "topk", "logsumexp", "argmax",
                                    "cumsum", "reduce")),
]


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


CLOCK_SKIP = 4  # decode steps of a timed generate left out of its cadence


def _median(sorted_values: list[float]) -> float:
    v, half = sorted_values, len(sorted_values) // 2
    return v[half] if len(v) % 2 else (v[half - 1] + v[half]) / 2


def timed_generate(sampler, prompts, tokens: int) -> float:
    from fp4rl.sampler import SamplingParams

    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=tokens, seed=0)
    _sync(sampler.device)
    t = time.perf_counter()
    sampler.generate(prompts, params)
    _sync(sampler.device)
    return time.perf_counter() - t


def replay_us(sampler, batch: int, n: int = 20):
    """Microseconds of one replay of the captured decode step of this batch's bucket, or None."""
    eng = sampler.engine
    if eng is None or not eng.graphs or sampler.device.type != "cuda":
        return None
    bucket = eng.bucket(batch)
    if eng.graph_key(bucket) not in eng.graphs:
        return None
    graph = eng.graphs[eng.graph_key(bucket)][0]
    with torch.inference_mode():
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def graph_check(sampler, prompts) -> dict:
    """Greedy decode with graphs vs the same engine stepping eagerly: tokens and logprobs."""
    from fp4rl.sampler import SamplingParams

    eng = sampler.engine
    if eng is None or not eng.graphs_enabled:
        return {"checked": False}
    params = SamplingParams(greedy=True, max_new_tokens=6)
    a = sampler.generate(prompts, params)
    eng.graphs_enabled = False
    try:
        b = sampler.generate(prompts, params)
    finally:
        eng.graphs_enabled = True
    same = all(x.completion_ids == y.completion_ids for x, y in zip(a, b))
    diff = max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x.logprobs, y.logprobs))
    return {"checked": True, "tokens_equal": same, "max_logprob_diff": diff}


def category(name: str) -> str:
    low = name.lower()
    for label, keys in CATEGORIES:
        if any(k in low for k in keys):
            return label
    return "elementwise / norm / copy / other"


def profile_split(sampler, batch: int, steps: int = 10, top_kernels: int = 12) -> dict:
    """CUDA kernel time by family of the engine's decode step for this batch, run eagerly `steps`
    times on the static buffers of the last generate (the kernels a graph replay runs; eager so
    that every kernel is visible to the profiler whatever it does with graphs); `top`: the
    `top_kernels` kernels that take the most time, with their calls per step; `chain`: replay_chain's
    split of the graph replay (or its error)."""
    from torch.profiler import ProfilerActivity, profile

    eng = sampler.engine
    bucket = eng.bucket(batch)
    with torch.inference_mode():
        eng._step(bucket)
        _sync(sampler.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                eng._step(bucket)
            _sync(sampler.device)
            wall = time.perf_counter() - t
    split: dict[str, float] = {}
    kernels: list[tuple[float, int, str]] = []
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0.0)
        split[category(evt.key)] = split.get(category(evt.key), 0.0) + us
        kernels.append((us, evt.count, evt.key))
    total = sum(split.values())
    top = [{"name": name[:120], "us_per_step": us / steps, "calls_per_step": count / steps}
           for us, count, name in sorted(kernels, reverse=True)[:top_kernels]]
    try:  # the graph replay's chain: which kernels the step waits on (PDL overlaps included)
        chain = replay_chain(sampler, batch, steps)
    except Exception as exc:  # noqa: BLE001 - the eager split stands without it
        chain = {"error": repr(exc)[:300]}
    return {"eager_wall_ms": wall * 1e3, "kernel_ms": total / 1e3, "steps": steps,
            "split_ms": {k: v / 1e3 for k, v in sorted(split.items(), key=lambda kv: -kv[1])}, "top": top,
            "chain": chain}


def chain_advance(kernels, steps: int, top: int = 12) -> dict:
    """Where a chain of kernels spends its time when they overlap (PDL, streams): kernels = [(start_us,
    end_us, name)] in any order. Sorted by start, each kernel's `advance` is how far it moves the latest end
    seen so far (its share of the span: the advances add up to the span less the idle gaps), its `gap` the
    idle time between that latest end and its start (0 when it overlaps), and its duration its own. Returns
    {"span_us", "busy_us", "idle_us"} per step and `top` kernel names by advance per step, each with its
    calls, duration, advance and gap per step."""
    if steps < 1:
        raise ValueError(f"chain_advance: steps must be >= 1, got {steps}")
    per: dict[str, list[float]] = {}
    kernels = sorted(kernels)
    first = last = kernels[0][0] if kernels else 0.0
    idle = 0.0
    for start, end, name in kernels:
        if end < start:
            raise ValueError(f"chain_advance: kernel {name!r} ends ({end}) before it starts ({start})")
        gap = max(0.0, start - last)
        advance = max(0.0, end - max(last, start))
        idle += gap
        last = max(last, end)
        acc = per.setdefault(name, [0, 0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += end - start
        acc[2] += advance
        acc[3] += gap
    span = last - first
    ranked = sorted(per.items(), key=lambda kv: -kv[1][2])[:top]
    return {"span_us": span / steps, "busy_us": (span - idle) / steps, "idle_us": idle / steps,
            "top": [{"name": name[:120], "calls_per_step": c / steps, "us_per_step": d / steps,
                     "advance_us_per_step": a / steps, "gap_us_per_step": g / steps}
                    for name, (c, d, a, g) in ranked]}


def captured_graph(sampler, batch: int, who: str):
    """The engine's captured decode graph for this batch's bucket; `who` names the caller in the error."""
    eng = sampler.engine
    bucket = eng.bucket(batch)
    entry = eng.graphs.get(eng.graph_key(bucket))
    if entry is None:
        raise RuntimeError(f"{who}: no captured graph for batch bucket {bucket} (generate at this batch with "
                           "graphs on first)")
    return entry[0]


def replay_chain(sampler, batch: int, steps: int = 10) -> dict:
    """chain_advance over `steps` graph replays of the engine's decode step for this batch (the kernels as the
    sampler runs them, PDL overlaps included; profile_split's are eager): which kernels the step waits on."""
    from torch.profiler import ProfilerActivity, profile

    graph = captured_graph(sampler, batch, "replay_chain")
    graph.replay()
    _sync(sampler.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        _sync(sampler.device)
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
               if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    if not kernels:
        raise RuntimeError("replay_chain: the profiler saw no kernel of the graph replays")
    return chain_advance(kernels, steps)


class _NoReplay:
    """Stands in for a captured graph: replay() does nothing (host_split's host-only steps)."""

    def replay(self):
        pass


def _clocked(sampler, prompts, tokens: int) -> tuple[float, float]:
    """(wall seconds of one generate of `tokens` new tokens, seconds per decode step from the sampler's step
    clock over the steps after CLOCK_SKIP); run() checks that enough steps remain."""
    sampler.step_clock = clock = []
    try:
        wall = timed_generate(sampler, prompts, tokens)
    finally:
        sampler.step_clock = None
    steady = clock[CLOCK_SKIP:]  # the steps after the first few (their launches queue behind prefill)
    return wall, (steady[-1] - steady[0]) / (len(steady) - 1)


def _cpu_ops(sampler, prompts, tokens: int) -> dict:
    """{operator: (self CPU us, calls)} over one generate of `tokens` new tokens (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        timed_generate(sampler, prompts, tokens)
    return {e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages()}


def host_split(sampler, prompts, n1: int, n2: int, top_ops: int = 15) -> dict:
    """Where the host's time per decode step goes, for the bucket of len(prompts) rows (after its row was
    measured, so the graph is captured): `replay_enqueue_us`, the host's cost of one graph launch (20 launches
    back to back, timed without a sync); `host_step_ms`, the decode cadence (step clock, median of 3
    generates) with every replay of this bucket's graph replaced by nothing (the GPU then runs only the step's
    small ops, so this is the host's cycle: a GPU step shorter than it leaves the GPU idle); `ops`, the
    `top_ops` CPU operators by self CPU time per decode step (torch.profiler over generates of n1 and n2 new
    tokens, the difference over n2 - n1: prefill and setup cancel out)."""
    eng = sampler.engine
    batch = len(prompts)
    bucket = eng.bucket(batch)
    key = eng.graph_key(bucket)
    if key not in eng.graphs or eng.graph_error is not None or not eng.graphs_enabled:
        return {"error": f"no graph in use for bucket {bucket} ({eng.graph_error or 'not captured'})"}
    graph, out, keep = eng.graphs[key]
    with torch.inference_mode():
        graph.replay()
        _sync(sampler.device)
        t = time.perf_counter()
        for _ in range(20):
            graph.replay()
        enqueue = (time.perf_counter() - t) / 20
        _sync(sampler.device)
    eng.graphs[key] = (_NoReplay(), out, keep)
    try:
        timed_generate(sampler, prompts, 4)
        host = _median(sorted(_clocked(sampler, prompts, n2)[1] for _ in range(3)))
    finally:
        eng.graphs[key] = (graph, out, keep)
    short, long = _cpu_ops(sampler, prompts, n1), _cpu_ops(sampler, prompts, n2)
    per = {k: ((us - short.get(k, (0, 0))[0]) / (n2 - n1), (c - short.get(k, (0, 0))[1]) / (n2 - n1))
           for k, (us, c) in long.items()}
    ops = sorted(per.items(), key=lambda kv: -kv[1][0])[:top_ops]
    return {"replay_enqueue_us": enqueue * 1e6, "host_step_ms": host * 1e3,
            "ops": [{"name": k[:100], "self_us_per_step": us, "calls_per_step": c} for k, (us, c) in ops]}

"""The table and notes `fp4rl bench sampler_gpu` prints from its results (``markdown``): one row per measured
arm (tokens/s, the ratio to the BF16 row of the same shape and batch, the step and graph-replay times, the
byte floor), then the profiles' and host timings' lines."""

from __future__ import annotations

import math


def _f(v, fmt="{:.2f}"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _mode(r) -> str:
    """'graph' when the row's decode steps were graph replays, 'eager' after a failed capture."""
    return "eager" if r.get("graph_error") or not r.get("graph_us") else "graph"


def _label(r) -> str:
    from fp4rl.kernels import pdl

    pdl_text = "" if r.get("pdl", True) else " (no PDL)"
    if r.get("pdl") and "pdl_off" in r and set(r["pdl_off"]) != pdl.DEFAULT_OFF:
        pdl_text = f" (no PDL: {'+'.join(r['pdl_off'])})" if r["pdl_off"] else " (PDL: all)"
    split = f" (split-K: {r['k_split']})" if "k_split" in r and r["precision"] != "bf16" else ""
    split += f" (KV write: {r['kv_write']})" if "kv_write" in r else ""
    split += " (mma16 stamps on: slower)" if r.get("mma16_stamps") else ""
    return r["precision"] + ("" if r.get("fused", True) else " (unfused)") + pdl_text + split


def markdown(results) -> str:
    rows = [r for r in results["rows"] if "error" not in r]
    base = {(r["shape"], r["batch"], r.get("fused"), r.get("pdl")): _mode(r) for r in rows
            if r["preset"] == "bf16" and r["kv"] == "bf16"}
    lines = ["| shape (layers built / full) | precision | KV | batch | decode | tok/s | vs BF16 | "
             "limit built / full depth | step ms | graph replay ms | byte floor tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} ({r['layers']}) | {_label(r)} | {r['kv']} | {r['batch']} | | "
                         f"error: {r['error'][:80]} | | | | | |")
            continue
        lim = f"{_f(r.get('limit_built'))} / {_f(r.get('limit_full'))}"
        vs = _f(r.get("vs_bf16"))
        key = (r["shape"], r["batch"], r.get("fused"), r.get("pdl"))
        if base.get(key) == "eager" and r["preset"] != "bf16":
            vs += " (BF16 eager)"
        graph_ms = r["graph_us"] / 1e3 if r.get("graph_us") else None
        flag = noisy(r["step_ms"], r.get("graph_us"), r.get("cadence_ms", []))  # (older records judged too)
        lines.append(f"| {r['shape']} ({r['layers']}/{r['full_layers']}) | {_label(r)} | {r['kv']} | "
                     f"{r['batch']} | {_mode(r)} | {_f(r['tok_s'], '{:.0f}')}{'*' * flag} "
                     f"| {vs} | {lim} | "
                     f"{_f(r['step_ms'])} | {_f(graph_ms)} | {_f(r.get('floor_tok_s'), '{:.0f}')} |")
    for p in results["profiles"]:
        if "error" in p:
            lines.append(f"\nprofile {p['shape']} {p['precision']} b{p['batch']}: error {p['error'][:100]}")
            continue
        parts = ", ".join(f"{k} {v / p['steps']:.2f}" for k, v in p["split_ms"].items())
        per = p["steps"]
        lines.append(f"\nprofile {p['shape']} {_label(p)} kv {p['kv']} b{p['batch']}: eager step "
                     f"{p['eager_wall_ms'] / per:.1f} ms, kernels {p['kernel_ms'] / per:.2f} ms: {parts}")
        for t in p.get("top", []):
            lines.append(f"  {t['us_per_step']:9.1f} us {t['calls_per_step']:6.1f} calls  {t['name']}")
    for h in results.get("hosts", []):
        if "error" in h:
            lines.append(f"\nhost {h['shape']} {h['precision']} b{h['batch']}: error {h['error'][:100]}")
            continue
        lines.append(f"\nhost {h['shape']} {_label(h)} kv {h['kv']} b{h['batch']}: graph launch "
                     f"{h['replay_enqueue_us']:.0f} us, host-only step {h['host_step_ms']:.2f} ms; CPU "
                     "operators per decode step:")
        for o in h["ops"]:
            lines.append(f"  {o['self_us_per_step']:9.1f} us {o['calls_per_step']:6.1f} calls  {o['name']}")
    return "\n".join(lines)


def arms_summary(paths) -> str:
    """The lines a device script prints after its arms (`python3 -m fp4rl.benchmarks.sampler_gpu_report
    FILE.json ...`): per results file its errors (a build or precision that failed), its builds' GPU memory,
    its rows' step / graph-replay times, tokens/s, memory peak or error, its checks (graph replay against
    eager), and its profiles' errors and in-kernel stamps (`--mma16-stamps`) by kind of launch, and the graph
    replay's chain (`--profile-batch`: decode_timing.replay_chain, each kernel's advance of the step per
    call). A file that is missing (an arm that timed out before writing it) is named, not fatal. Last,
    `compare`'s lines over the files' rows."""
    import json
    from pathlib import Path

    lines = []
    arms = {}
    for path in paths:
        name = Path(path).name.removesuffix(".json")
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            lines.append(f"{name}: no results ({exc})")
            continue
        arms[name] = d.get("rows", [])
        for err in d.get("errors", []):  # a build or a precision that failed before any row
            lines.append(f"{name} error {err}")
        for b in d.get("builds", []):
            if "gpu_peak_gib" in b:  # (recorded since the forty-seventh session)
                lines.append(f"{name} build {b['build_s']:.1f} s: GPU {b['gpu_gib']:.2f} GiB after it, "
                             f"{b['gpu_peak_gib']:.2f} GiB at its peak")
        for r in d.get("rows", []):
            keep = {k: r[k] for k in ("step_ms", "graph_us", "tok_s", "gpu_peak_gib", "error")
                    if k in r}
            lines.append(f"{name} batch {r['batch']} {keep}")
        checks = [{k: c[k] for k in ("batch", "tokens_equal", "max_logprob_diff", "error") if k in c}
                  for c in d.get("checks", [])]
        if checks:
            lines.append(f"{name} checks {checks}")
        for p in d.get("profiles", []):
            if "error" in p:
                lines.append(f"{name} profile batch {p.get('batch')} error {p['error']}")
            c = p.get("chain") or {}
            if "error" in c:
                lines.append(f"{name} chain batch {p['batch']} error {c['error']}")
            elif c:
                lines.append(f"{name} chain batch {p['batch']} span {c['span_us']:.1f} us, busy "
                             f"{c['busy_us']:.1f}, idle {c['idle_us']:.1f} a step; advance / call, "
                             "duration / call, calls a step:")
                for k in c.get("top", []):
                    calls = k["calls_per_step"]
                    lines.append(f"  {k['advance_us_per_step'] / calls:7.2f} us "
                                 f"{k['us_per_step'] / calls:7.2f} us {calls:5.0f}  {k['name'][:80]}")
            s = p.get("stamps") or {}
            if not s:
                continue
            head = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items() if k != "kinds"}
            lines.append(f"{name} stamps batch {p['batch']} {head}")
            for kind, k in (s.get("kinds") or {}).items():
                lines.append(f"  {kind:22s} " + " ".join(f"{key} {v:.2f}" if isinstance(v, float) else
                                                       f"{key} {v}" for key, v in k.items()))
    return "\n".join(lines + compare(arms))


NOISY_SPREAD = 1.1  # the slowest generate's cadence over the fastest one's above which a row is flagged


def noisy(step_ms: float, graph_us: float | None, cadence_ms: list[float]) -> bool:
    """Whether a row's figure cannot be trusted (a * in the table): its step reads faster than its own graph
    replay, which cannot be, or its generates' cadences scatter by more than NOISY_SPREAD (a host hiccup
    in one of them: with two repeats the median is their mean, so one disturbed generate moves the figure;
    session 38's ROUTER_NORM arm read 1.23 and 1.83 ms around a 1.16 ms replay)."""
    if graph_us and step_ms < 0.95 * graph_us / 1e3:
        return True
    return bool(cadence_ms) and max(cadence_ms) > NOISY_SPREAD * min(cadence_ms)


def _variant(name: str, names) -> str:
    """What follows an arm's first word once the arms' common prefix is gone: 'sampler152_8b_defaults_t128'
    among 'sampler152_8b_*' -> 't128'; '' for 'sampler152_8b_defaults' (the arm's variant, by which an NVFP4
    arm finds its BF16 arm in `compare`)."""
    import os

    prefix = os.path.commonprefix(list(names))
    prefix = prefix[:prefix.rfind("_") + 1]  # whole words only
    rest = name[len(prefix):]
    return rest.split("_", 1)[1] if "_" in rest else ""


def compare(arms: dict) -> list[str]:
    """Per shape and batch, the arms' step ms side by side (arms: {name: rows}, in order): each against the
    first arm that has the batch (+x.x%: slower), and where an arm ran BF16 (preset bf16) the BF16 step over
    each NVFP4 arm's (the speedup the issue's targets name): over the BF16 arm of the same variant where there
    is one (`_variant`: 'defaults_t128' against 'bf16_t128', named after the ratio), else the first BF16 arm;
    * after a noisy step (`noisy`, from the row's own cadences, so older records are judged too). Rows with an
    error are left out."""
    variant = {n: _variant(n, arms) for n in arms}
    by_key: dict = {}
    for name, rows in arms.items():
        for r in rows:
            if "error" not in r and r.get("step_ms"):
                by_key.setdefault((r.get("shape"), r["batch"]), []).append((name, r))
    lines = []
    for (shape, batch), got in sorted(by_key.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        if len(got) < 2:
            continue
        nvfp4 = [(n, r) for n, r in got if r.get("preset") != "bf16"]
        bf16s = [(n, r) for n, r in got if r.get("preset") == "bf16"]
        bf16 = bf16s[0][1] if bf16s else None
        first = nvfp4[0][1]["step_ms"] if nvfp4 else None
        parts = []
        for n, r in got:
            flag = noisy(r["step_ms"], r.get("graph_us"), r.get("cadence_ms", []))
            text = f"{n} {r['step_ms']:.3f}" + "*" * flag
            if r.get("preset") != "bf16" and first and r is not nvfp4[0][1]:
                text += f" ({100 * (r['step_ms'] / first - 1):+.1f}%)"
            parts.append(text)
        line = f"{shape} batch {batch} step ms: " + ", ".join(parts)
        if bf16 is not None and nvfp4:
            ratios = []
            for n, r in nvfp4:
                same = [(bn, br) for bn, br in bf16s[1:] if variant[bn] == variant[n] != ""]
                base = same[0][1] if same else bf16
                vs = f" (vs {same[0][0]})" if same else ""
                ratios.append(f"{n} {base['step_ms'] / r['step_ms']:.2f}x{vs}")
            line += "; BF16 / arm: " + ", ".join(ratios)
        lines.append(line)
    return lines


if __name__ == "__main__":
    import sys

    print(arms_summary(sys.argv[1:]))

"""In-kernel timestamps of the CUDA mma16 GEMMs inside a decode step's graph replay (diagnostics, bench only).

``enable(device)`` makes every mma16 kernel compiled there from then on stamp %globaltimer in thread 0 of each
CTA at five points (gemv_mma16.cu, STAMP_BUF): its start (the CTA became resident: under programmatic
dependent launch, possibly long before the previous kernel ends), after griddepcontrol.wait (the previous
kernel's results are visible), once x is staged, after its weight stream and before it leaves. ``replay``
replays a sampler's captured decode step with the stamps on, and ``summary`` turns the records into where a
GEMM's time goes in the graph as the sampler runs it: from its release to x, to the end of the stream and to
its last CTA's exit, and the gap from the previous mma16 launch's last exit to its release (which holds the
kernels between them and the hand-offs from one grid to the next). Each CTA then does one atomic and 64 bytes
of stores more, so time a step without stamps for its speed.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import statistics

import torch

from fp4rl.kernels import gemv_cuda

SLOTS = 524288  # records the buffer holds (gemv_mma16.cu: STAMP_SLOTS; 32 MB)
FIELDS = ("start", "wait", "x", "stream", "exit")  # a record's %globaltimer stamps, ns
# a launch's CTAs, sorted by their wait, follow each other closer than this (waves included); launches of one
# kind are a layer apart
GAP_NS = 10_000


def _index(device) -> int:
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"the mma16 stamps need a CUDA device, got {dev}")
    return dev.index if dev.index is not None else torch.cuda.current_device()


def enable(device) -> None:
    """Stamps on for the mma16 kernels compiled on `device` from now on. Compiled kernels are dropped so that
    the next launches rebuild with the stamps: enable before a sampler captures its graphs."""
    dev = _index(device)
    buf = gemv_cuda.STAMPS.get(dev)
    if buf is None:
        buf = torch.zeros(8 + 8 * SLOTS, dtype=torch.int64, device=torch.device("cuda", dev))
    gemv_cuda.set_stamp_buffer(dev, buf)


def disable(device) -> None:
    """Stamps off again for `device`: the kernels compiled from now on are the plain builds."""
    gemv_cuda.set_stamp_buffer(_index(device), None)


def enabled(device) -> bool:
    return torch.device(device).type == "cuda" and _index(device) in gemv_cuda.STAMPS


def reset(device) -> None:
    """Forget the records taken so far."""
    gemv_cuda.STAMPS[_index(device)][0].zero_()


def decode(buf: torch.Tensor) -> list[dict]:
    """The records of a stamp buffer (int64 [8 + 8 * SLOTS], u64 [0] = records taken), one per CTA in the
    order the CTAs left: FIELDS in ns, then n, k, m (the CTA's rows), the CTA (bx, by, bz), its SM, grouped,
    split, kw and cycles (clock64 from its start to its exit)."""
    taken = int(buf[0])
    if taken > SLOTS:
        raise RuntimeError(f"{taken} CTAs stamped, the buffer holds {SLOTS}: replay fewer steps")
    out = []
    for rec in buf[8:8 + 8 * taken].view(taken, 8).tolist():
        nk, cta, flags = rec[5], rec[6], rec[7]
        d = dict(zip(FIELDS, rec[:5]))
        d.update(n=nk & 0xFFFFFFFF, k=(nk >> 32) & 0xFFFFFFFF, m=flags & 0xFFFF, bx=cta & 0xFFFF,
                 by=(cta >> 16) & 0xFFFF, bz=(cta >> 32) & 0xFFFF, sm=(cta >> 48) & 0xFFFF,
                 grouped=(flags >> 16) & 0xF, split=(flags >> 20) & 0xF, kw=(flags >> 24) & 0xFF,
                 cycles=(flags >> 32) & 0xFFFFFFFF)
        out.append(d)
    return out


def read(device) -> list[dict]:
    """``decode`` of `device`'s buffer (enable first)."""
    dev = _index(device)
    if dev not in gemv_cuda.STAMPS:
        raise RuntimeError("stamps.read: call stamps.enable(device) before the kernels are compiled")
    return decode(gemv_cuda.STAMPS[dev].cpu())


def kind(rec: dict) -> str:
    return f"{'grouped ' if rec['grouped'] else ''}{rec['n']}x{rec['k']}"


def launches(records: list[dict], gap_ns: int = GAP_NS) -> list[dict]:
    """The records grouped into launches (a kind's CTAs sorted by their wait, a new launch wherever two follow
    each other by more than gap_ns: a grid's later waves stay in its launch), in the order of their release
    (first wait), each with its CTAs' extremes."""
    out = [_launch(kind(group[0]), group) for group in _groups(records, gap_ns)]
    out.sort(key=lambda lch: lch["wait"])
    return out


def _groups(records: list[dict], gap_ns: int) -> list[list[dict]]:
    """The records of each launch (see ``launches``)."""
    out = []
    by_kind: dict[str, list[dict]] = {}
    for r in records:
        by_kind.setdefault(kind(r), []).append(r)
    for recs in by_kind.values():
        recs.sort(key=lambda r: r["wait"])
        group: list[dict] = []
        for r in recs + [None]:
            if group and (r is None or r["wait"] - group[-1]["wait"] > gap_ns):
                out.append(group)
                group = []
            if r is not None:
                group.append(r)
    return out


def _launch(name: str, group: list[dict]) -> dict:
    cta = {  # per CTA: its own spans, ns
        "x": [r["x"] - r["wait"] for r in group],
        "stream": [r["stream"] - r["x"] for r in group],
        "tail": [r["exit"] - r["stream"] for r in group],
    }
    return {"kind": name, "ctas": len(group), "start": min(r["start"] for r in group),
            "wait": min(r["wait"] for r in group), "wait_last": max(r["wait"] for r in group),
            "x": max(r["x"] for r in group), "stream": max(r["stream"] for r in group),
            "exit": max(r["exit"] for r in group),
            **{f"cta_{k}": statistics.median(v) for k, v in cta.items()}}


def summary(records: list[dict], steps: int, gap_ns: int = GAP_NS) -> dict:
    """Per kind of launch (medians over its launches, us): `early` (its first CTA resident before its
    release), `wait_spread` (first to last CTA past the wait), `x` / `stream` / `exit` (release to the last
    CTA's x staged / stream done / exit), `from_prev` (the previous mma16 launch's last exit to this release)
    and `after` (the kind most often before it); the median CTA's own x, stream and tail spans. Per step: the
    launches' release-to-exit spans and the gaps between them, summed, and `tick_ns` (the smallest step
    between distinct stamps: the timer's resolution, or finer)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    seq = launches(records, gap_ns)
    if not seq:
        raise RuntimeError("no mma16 stamps: were the kernels compiled after stamps.enable?")
    rows: dict[str, dict[str, list]] = {}
    own = gaps = 0
    for i, lch in enumerate(seq):
        r = rows.setdefault(lch["kind"], {k: [] for k in ("early", "wait_spread", "x", "stream", "exit",
                                                          "from_prev", "after", "ctas", "cta_x",
                                                          "cta_stream", "cta_tail")})
        r["early"].append(lch["wait"] - lch["start"])
        r["wait_spread"].append(lch["wait_last"] - lch["wait"])
        for key in ("x", "stream", "exit"):
            r[key].append(lch[key] - lch["wait"])
        for key in ("cta_x", "cta_stream", "cta_tail"):
            r[key].append(lch[key])
        r["ctas"].append(lch["ctas"])
        own += lch["exit"] - lch["wait"]
        if i:
            r["from_prev"].append(lch["wait"] - seq[i - 1]["exit"])
            r["after"].append(seq[i - 1]["kind"])
            gaps += lch["wait"] - seq[i - 1]["exit"]
    kinds = {}
    for name, r in rows.items():
        med = {k: statistics.median(v) / 1e3 for k, v in r.items() if v and k not in ("after", "ctas")}
        kinds[name] = {"launches_per_step": len(r["ctas"]) / steps, "ctas": statistics.median(r["ctas"]),
                       **med, "after": max(set(r["after"]), key=r["after"].count) if r["after"] else None}
    stamps = sorted({r[f] for r in records for f in FIELDS})
    steps_between = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"launches_per_step": len(seq) / steps, "own_us_per_step": own / steps / 1e3,
            "gaps_us_per_step": gaps / steps / 1e3, "span_us": (seq[-1]["exit"] - seq[0]["wait"]) / 1e3,
            "tick_ns": min(steps_between) if steps_between else None, "kinds": kinds}


def by_sm_load(records: list[dict], gap_ns: int = GAP_NS) -> dict:
    """Per kind of launch, its CTAs grouped by how many CTAs of the same launch shared their SM (%smid): for
    each share count the CTAs, and their medians (us) of the stream (x to the last weight step) and of the
    exit after the launch's release. A grid of C CTAs on S SMs leaves C mod S SMs one CTA more: where those
    CTAs end later, the launch ends with them (the thirty-third session's reading: bench/gpu_kernels.md).
    A grid of more than one wave counts its later waves' CTAs as sharing the SM with the earlier ones."""
    rows: dict[str, dict[int, dict[str, list]]] = {}
    for group in _groups(records, gap_ns):  # one launch's CTAs
        release = min(r["wait"] for r in group)
        per_sm = collections.Counter(r["sm"] for r in group)
        by_share = rows.setdefault(kind(group[0]), {})
        for r in group:
            cell = by_share.setdefault(per_sm[r["sm"]], {"stream": [], "exit": []})
            cell["stream"].append(r["stream"] - r["x"])
            cell["exit"].append(r["exit"] - release)
    return {name: {share: {"ctas": len(c["stream"]), "stream_us": statistics.median(c["stream"]) / 1e3,
                           "exit_us": statistics.median(c["exit"]) / 1e3}
                   for share, c in sorted(by_share.items())}
            for name, by_share in rows.items()}


def save_records(records: list[dict], path) -> None:
    """The raw records as gzipped JSON (one list per field, FIELDS first), to group or read them again without
    a GPU (``load_records``)."""
    keys = list(records[0]) if records else list(FIELDS)
    with gzip.open(path, "wt") as fh:
        json.dump({k: [r[k] for r in records] for k in keys}, fh)


def load_records(path) -> list[dict]:
    with gzip.open(path, "rt") as fh:
        cols = json.load(fh)
    keys = list(cols)
    return [dict(zip(keys, vals)) for vals in zip(*(cols[k] for k in keys))]


def records_path(out: str, shape: str, label: str, batch: int) -> str:
    """Where a benchmark row's raw records go: beside its results file `out`, one plain file name per row."""
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{shape}_{label}_b{batch}")
    return f"{out}.stamps_{tag}.json.gz"


def replay(sampler, batch: int, steps: int = 1, records_path=None) -> dict:
    """``summary`` of `steps` graph replays of the engine's decode step for this batch (enable before the
    graphs are captured); records_path: also the raw records there (``save_records``). `x_at`: where the
    builds took their third stamp (gemv_cuda.STAMP_AT: 0 x staged, 1 the expert found, 2 x issued)."""
    from fp4rl.benchmarks.decode_timing import captured_graph

    graph = captured_graph(sampler, batch, "stamps.replay")
    graph.replay()
    torch.cuda.synchronize(sampler.device)
    reset(sampler.device)
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize(sampler.device)
    records = read(sampler.device)
    if records_path is not None:
        save_records(records, records_path)
    return {**summary(records, steps), "x_at": gemv_cuda.STAMP_AT}


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        raise SystemExit("usage: python3 -m fp4rl.benchmarks.stamps RECORDS.json.gz   (a --mma16-stamps "
                         "run's raw records: each kind of launch's CTAs by how many shared their SM)")
    for name, shares in by_sm_load(load_records(sys.argv[1])).items():
        for share, c in shares.items():
            print(f"{name:22s} {share} a SM: {c['ctas']:6d} CTAs, stream {c['stream_us']:.2f} us, "
                  f"exit {c['exit_us']:.2f} us after the release")

"""fp4rl.benchmarks.stamps: on CPU the record layout gemv_mma16.cu writes (STAMP_BUF) decoded, and the
launches and per-kind spans of a made-up decode step; on the GPU (-m gpu) the stamped kernel's records."""

import pytest
import torch

from fp4rl.benchmarks import stamps


def _buffer(records):
    """Records encoded as gemv_mma16.cu's stamp_write writes them (u64 [0]: records taken)."""
    buf = torch.zeros(8 + 8 * stamps.SLOTS, dtype=torch.int64)
    buf[0] = len(records)
    for i, r in enumerate(records):
        row = [r[f] for f in stamps.FIELDS]
        row.append(r["n"] | (r["k"] << 32))
        row.append(r["bx"] | (r["by"] << 16) | (r["bz"] << 32) | (r["sm"] << 48))
        row.append(r["m"] | (r["grouped"] << 16) | (r["split"] << 20) | (r["kw"] << 24) | (r["cycles"] << 32))
        buf[8 + 8 * i:16 + 8 * i] = torch.tensor(row, dtype=torch.int64)
    return buf


def _cta(t0, wait, x, stream, exit_, n, k, grouped=0, bx=0, sm=0):
    return {"start": t0, "wait": wait, "x": x, "stream": stream, "exit": exit_, "n": n, "k": k, "m": 1,
            "bx": bx, "by": 0, "bz": 3 if grouped else 0, "sm": sm, "grouped": grouped, "split": 1, "kw": 4,
            "cycles": 12345}


def _step(base):
    """One layer's two kinds: a dense 5120x2048 launch of 2 CTAs, then a grouped 2048x768 one of 2 CTAs."""
    return [
        _cta(base, base + 1000, base + 1500, base + 2500, base + 3000, 5120, 2048, bx=0, sm=7),
        _cta(base + 200, base + 1100, base + 1800, base + 2600, base + 3300, 5120, 2048, bx=1, sm=131),
        _cta(base + 2000, base + 5300, base + 6000, base + 7000, base + 7600, 2048, 768, grouped=1),
        _cta(base + 2100, base + 5400, base + 6100, base + 7200, base + 8000, 2048, 768, grouped=1, bx=1),
    ]


def test_decode_inverts_the_kernel_layout():
    recs = _step(10**12)
    out = stamps.decode(_buffer(recs))
    assert len(out) == 4
    for got, want in zip(out, recs):
        assert {k: got[k] for k in want} == want
    assert stamps.kind(out[0]) == "5120x2048" and stamps.kind(out[2]) == "grouped 2048x768"


def test_decode_refuses_an_overflowed_buffer():
    buf = _buffer([])
    buf[0] = stamps.SLOTS + 1
    with pytest.raises(RuntimeError, match="replay fewer steps"):
        stamps.decode(buf)


def test_summary_spans_and_gaps():
    base = 10**12
    recs = _step(base) + _step(base + 50_000)  # two steps, 50 us apart
    seq = stamps.launches(stamps.decode(_buffer(recs)))
    assert [lch["kind"] for lch in seq] == ["5120x2048", "grouped 2048x768"] * 2
    assert [lch["ctas"] for lch in seq] == [2, 2, 2, 2]
    s = stamps.summary(recs, steps=2)
    assert s["launches_per_step"] == 2
    dense, grouped = s["kinds"]["5120x2048"], s["kinds"]["grouped 2048x768"]
    assert dense["early"] == pytest.approx(1.0) and dense["wait_spread"] == pytest.approx(0.1)
    assert dense["x"] == pytest.approx(0.8) and dense["stream"] == pytest.approx(1.6)
    assert dense["exit"] == pytest.approx(2.3)
    assert dense["cta_x"] == pytest.approx(0.6) and dense["cta_tail"] == pytest.approx(0.6)
    # the grouped launch is released 2.0 us after the dense launch's last exit (base + 3300 -> base + 5300)
    assert grouped["from_prev"] == pytest.approx(2.0) and grouped["after"] == "5120x2048"
    # the second dense launch follows the first step's grouped one: 50_000 + 1000 - 8000 ns
    assert dense["from_prev"] == pytest.approx(43.0) and dense["after"] == "grouped 2048x768"
    assert s["own_us_per_step"] == pytest.approx((2.3 + 2.7) * 2 / 2)
    assert s["gaps_us_per_step"] == pytest.approx((2.0 + 43.0 + 2.0) / 2)
    assert s["tick_ns"] == 100


def test_summary_needs_records():
    with pytest.raises(RuntimeError, match="no mma16 stamps"):
        stamps.summary([], steps=1)
    with pytest.raises(ValueError, match="steps"):
        stamps.summary(_step(0), steps=0)


def test_the_kernel_and_the_reader_agree_on_the_slots():
    import re
    from pathlib import Path

    src = (Path(stamps.__file__).parents[1] / "kernels" / "gemv_mma16.cu").read_text()
    assert int(re.search(r"#define STAMP_SLOTS (\d+)", src).group(1)) == stamps.SLOTS


def test_a_grids_later_wave_stays_in_its_launch():
    """CTAs of one launch that pass their wait in waves (here 6 us apart each, 18 us from first to last) are
    one launch; the same kind a layer later is another."""
    base = 10**12
    wave = [_cta(base + 6000 * i, base + 1000 + 6000 * i, base + 2000 + 6000 * i, base + 3000 + 6000 * i,
                 base + 4000 + 6000 * i, 2048, 768, grouped=1, bx=i) for i in range(4)]
    t = base + 60_000
    later = [_cta(t, t + 1000, t + 2000, t + 3000, t + 4000, 2048, 768, grouped=1)]
    seq = stamps.launches(wave + later)
    assert [lch["ctas"] for lch in seq] == [4, 1]
    assert seq[0]["wait_last"] - seq[0]["wait"] == 18_000


def test_raw_records_round_trip(tmp_path):
    recs = stamps.decode(_buffer(_step(10**12)))
    path = tmp_path / "stamps.json.gz"
    stamps.save_records(recs, path)
    assert stamps.load_records(path) == recs
    assert stamps.summary(stamps.load_records(path), steps=1) == stamps.summary(recs, steps=1)


def test_by_sm_load_splits_a_launch_by_the_ctas_on_each_sm():
    """Three CTAs of one launch, two of them on SM 5: per share count the CTAs, their median stream and their
    median exit after the launch's release (its first wait)."""
    base = 10**12
    recs = [_cta(base, base + 1000, base + 1500, base + 2500, base + 3000, 5120, 2048, bx=0, sm=5),
            _cta(base, base + 1100, base + 1600, base + 3600, base + 4100, 5120, 2048, bx=1, sm=5),
            _cta(base, base + 1000, base + 1400, base + 2200, base + 2500, 5120, 2048, bx=2, sm=9)]
    got = stamps.by_sm_load(recs)["5120x2048"]
    assert set(got) == {1, 2}
    assert got[1] == {"ctas": 1, "stream_us": pytest.approx(0.8), "exit_us": pytest.approx(1.5)}
    assert got[2] == {"ctas": 2, "stream_us": pytest.approx(1.5), "exit_us": pytest.approx(2.55)}


def test_by_sm_load_on_a_recorded_step():
    """The thirty-third session's records (device_run102: Qwen3-30B-A3B W4A16, batch 1, 48 layers, the
    experts' gate / up on 192 CTAs): per launch 68 SMs held two gate / up CTAs, 56 one and 8 none; those
    sharing their SM ended later than those alone."""
    from pathlib import Path

    path = (Path(__file__).parents[1] / "bench" / "data" / "s33" /
            "sampler102_tlb16_stamps.json.stamps_qwen3-30b-a3b_nvfp4-w4a16_all_linears_b1.json.gz")
    got = stamps.by_sm_load(stamps.load_records(path))
    gate_up = got["grouped 1536x2048"]
    assert {k: v["ctas"] for k, v in gate_up.items()} == {1: 56 * 48, 2: 2 * 68 * 48}
    assert gate_up[2]["exit_us"] > gate_up[1]["exit_us"] + 0.5
    assert sum(c["ctas"] for c in got["2048x4096"].values()) == 128 * 48


@pytest.mark.gpu
def test_gpu_stamps_record_every_cta_in_order_and_keep_the_bits():
    """fp4rl.benchmarks.stamps: the stamped build gives the plain build's bits, every CTA of a launch leaves
    one record (start <= wait <= x <= stream <= exit) naming its shape, and a graph of two chained launches
    reads back as two launches, the second released after the first's last exit."""
    from fp4rl.kernels import gemv_cuda

    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    from test_gemv_cuda import _gpu_case  # (the tests folder is on sys.path: gpu_decode_cases)

    n, k = 1008, 1280
    _, wc, _, g, base = _gpu_case(n, k, {}, 8, seed=5)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfgs = {1: None, 8: gemv_cuda.choose(n, k, 8, sms)}  # (8 rows: the mma.sync build, not choose_narrow's)
    plain = {m: gemv_cuda.launch(base[:m], wc, g, torch.empty(m, n, dtype=torch.bfloat16, device="cuda"),
                                 cfg=cfgs[m]) for m in (1, 8)}
    stamps.enable("cuda")
    try:
        for m in (1, 8):
            stamps.reset("cuda")
            y = gemv_cuda.launch(base[:m], wc, g, torch.empty(m, n, dtype=torch.bfloat16, device="cuda"),
                                 cfg=cfgs[m])
            torch.cuda.synchronize()
            assert torch.equal(y, plain[m])
            recs = stamps.read("cuda")
            cfg = gemv_cuda.in_cta_split(gemv_cuda.choose(n, k, m, sms), k, m) if m == 1 else \
                gemv_cuda.choose(n, k, m, sms)
            assert len(recs) == -(-n // gemv_cuda.block_rows(cfg)) * cfg["SPLIT"]
            for r in recs:
                assert r["start"] <= r["wait"] <= r["x"] <= r["stream"] <= r["exit"], r
                assert (r["n"], r["k"], r["m"], r["grouped"], r["split"]) == (n, k, m, 0, cfg["SPLIT"])
                assert r["cycles"] > 0
        # a chain x -> h -> y: h (1008 wide) padded to K = 1024 for the second weight
        _, wc2, _, g2, _ = _gpu_case(1024, 1024, {}, 1, seed=6)
        x = base[:1]
        h = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        h2 = torch.zeros(1, 1024, dtype=torch.bfloat16, device="cuda")
        y = torch.empty(1, 1024, dtype=torch.bfloat16, device="cuda")
        for _ in range(2):  # compile outside the capture
            gemv_cuda.launch(x, wc, g, h)
            h2[:, :n].copy_(h)
            gemv_cuda.launch(h2, wc2, g2, y)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemv_cuda.launch(x, wc, g, h)
            h2[:, :n].copy_(h)
            gemv_cuda.launch(h2, wc2, g2, y)
        graph.replay()
        torch.cuda.synchronize()
        stamps.reset("cuda")
        graph.replay()
        torch.cuda.synchronize()
        seq = stamps.launches(stamps.read("cuda"))
        assert [s["kind"] for s in seq] == [f"{n}x{k}", f"1024x{h2.shape[1]}"]
        assert seq[1]["wait"] >= seq[0]["exit"]
        s = stamps.summary(stamps.read("cuda"), steps=1)
        assert s["kinds"][f"1024x{h2.shape[1]}"]["from_prev"] >= 0
    finally:
        stamps.disable("cuda")
    assert not stamps.enabled("cuda")


def test_stamps_path_is_one_plain_file_name_per_row():
    label = "nvfp4-w4a16 all linears (no PDL: mma+wide)"
    path = stamps.records_path("/tmp/x/s.json", "qwen3-30b-a3b", label, 8)
    assert path.startswith("/tmp/x/s.json.stamps_qwen3-30b-a3b_nvfp4-w4a16_all_linears_no_PDL_mma_wide")
    assert path.endswith("_b8.json.gz") and " " not in path and path.count("/") == 3

"""`fp4rl bench sampler_gpu`'s arms on the CPU: the --lm-head rows (a contract rule quantizing the head) and
the weight bytes a decode step reads with a BF16 or an NVFP4 head."""

import pytest
import torch

from fp4rl.benchmarks import sampler_gpu, sampler_gpu_report


def test_lm_head_settings():
    assert sampler_gpu.lm_head_settings("bf16") == ["bf16"]
    assert sampler_gpu.lm_head_settings("w4a16, bf16,w4a16") == ["w4a16", "bf16"]
    for bad in ("", "w4a4", "bf16,fp8"):
        with pytest.raises(ValueError, match="--lm-head"):
            sampler_gpu.lm_head_settings(bad)


def test_step_bytes_count_an_nvfp4_head():
    """With the rule ('lm_head', 'w4a16') the sampler's head is packed NVFP4 and a step reads 0.5625 B per
    head weight instead of 2; the decoder layers' bytes do not change."""
    from fp4rl.packed import PackedNVFP4Linear
    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import convert
    from fp4rl.sampler import Sampler, SamplingParams

    trainer = sampler_gpu.build_trainer(sampler_gpu.SHAPES["tiny"], 2, torch.device("cpu"))
    cfg = trainer.config
    per_step = {}
    for head in ("bf16", "w4a16"):
        rules = (("lm_head", head),) if head != "bf16" else ()
        contract = PrecisionContract("nvfp4-w4a16", bf16_last_fraction=0.0, rules=rules)
        convert(trainer, contract)
        sampler = Sampler(trainer, dtype=torch.bfloat16, eos_token_ids=[], max_seq_len=32)
        assert isinstance(sampler.model.lm_head, PackedNVFP4Linear) == (head == "w4a16")
        per_step[head] = sampler_gpu.step_bytes(sampler, contract, 2, 1)
        out = sampler.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, greedy=True))
        assert len(out[0].completion_ids) == 3
    head_params = cfg.vocab_size * cfg.hidden_size
    for key in ("built", "full"):
        assert per_step["bf16"][key] - per_step["w4a16"][key] == pytest.approx(head_params * (2 - 0.5625))


def test_kv_write_setting(monkeypatch):
    from fp4rl import gpu_decode

    monkeypatch.setattr(gpu_decode, "FUSED_KV_FP4", True)
    assert sampler_gpu.kv_write_setting("default") is True
    assert sampler_gpu.kv_write_setting("separate") is False
    monkeypatch.setattr(gpu_decode, "FUSED_KV_FP4", False)
    assert sampler_gpu.kv_write_setting("default") is False and sampler_gpu.kv_write_setting("fused") is True
    with pytest.raises(ValueError, match="--kv-write item 'both'"):
        sampler_gpu.kv_write_setting("both")


def _args(*argv):
    import argparse

    parser = argparse.ArgumentParser()
    sampler_gpu.add_arguments(parser)
    return parser.parse_args(["--device", "cpu", "--shapes", "tiny:2", *argv])


@pytest.mark.parametrize("argv,message", [
    (("--profile-kv", "bf16,nvpf4"), "--profile-kv item 'nvpf4'"),
    (("--dense-rows", "0,-128"), "--dense-rows '0,-128': integers >= 0"),
])
def test_bad_settings_stop_the_run_before_any_model_is_built(argv, message):
    """--profile-kv names KV formats, --dense-rows row counts: a typo stops the run before any build."""
    with pytest.raises(SystemExit, match=message):
        sampler_gpu.run(_args(*argv))


def test_chain_advance_splits_an_overlapping_chain():
    """Graph-replay kernels that overlap (PDL): each kernel's advance is how far it moves the latest end, gaps
    are the idle time before a kernel; advances + gaps add up to the span, per step."""
    from fp4rl.benchmarks.decode_timing import chain_advance

    # two steps of: a [0, 10), b [8, 15) overlaps a's tail, c [20, 22) after 5 us idle, d [16, 18) inside
    # nothing but after b (gap 1), e [9, 12) wholly inside a and b (advance 0)
    step = [(0, 10, "a"), (8, 15, "b"), (15 + 1, 18, "d"), (20, 22, "c"), (9, 12, "e")]
    kernels = step + [(s + 100, e + 100, n) for s, e, n in reversed(step)]
    out = chain_advance(kernels, steps=2)
    top = {k["name"]: k for k in out["top"]}
    assert top["a"]["advance_us_per_step"] == 10 and top["b"]["advance_us_per_step"] == 5
    assert top["e"]["advance_us_per_step"] == 0 and top["e"]["us_per_step"] == 3
    assert top["d"]["gap_us_per_step"] == 1 and top["d"]["advance_us_per_step"] == 2
    assert top["c"]["gap_us_per_step"] == 2 and top["c"]["advance_us_per_step"] == 2
    # the span runs from the first start to the last end (122 us over 2 steps); idle: 1 + 2 per step and the
    # 78 us between the steps
    assert out["span_us"] == 61 and out["idle_us"] == (2 * 3 + 78) / 2
    assert out["busy_us"] == sum(k["advance_us_per_step"] for k in out["top"]) == 19
    assert [k["name"] for k in out["top"]][:2] == ["a", "b"] and top["a"]["calls_per_step"] == 1
    with pytest.raises(ValueError, match="ends"):
        chain_advance([(5, 4, "x")], steps=1)
    with pytest.raises(ValueError, match="steps"):
        chain_advance(step, steps=0)


def test_stamped_rows_say_so_in_the_table():
    """A row measured with --mma16-stamps (slower kernels) is labelled so in the markdown table."""
    from fp4rl.benchmarks.sampler_gpu_report import _label

    row = {"precision": "nvfp4-w4a16 all linears", "pdl": True, "fused": True}
    assert "stamps" not in _label(row)
    assert "(mma16 stamps on: slower)" in _label({**row, "mma16_stamps": True})


def test_arms_summary_of_recorded_runs(tmp_path):
    """What a device script prints after its arms, from the thirty-third session's results files: each row's
    step time, the graph-vs-eager check, the stamps by kind of launch; a missing file (an arm killed before
    it wrote) is named and the others still print."""
    from pathlib import Path

    from fp4rl.benchmarks.sampler_gpu_report import arms_summary

    data = Path(__file__).parents[1] / "bench" / "data" / "s33"
    import json

    failed = tmp_path / "failed.json"  # an arm whose model build failed: no rows, its error
    failed.write_text(json.dumps({"rows": [], "profiles": [{"batch": 1, "error": "RuntimeError('x')"},
                                               {"batch": 8, "chain": {"error": "RuntimeError('no kernel')"}}],
                                  "errors": [{"shape": "qwen3-8b", "stage": "build", "error": "OOM"}],
                                  "builds": [{"build_s": 53.62, "gpu_gib": 36.41, "gpu_peak_gib": 38.2}]}))
    text = arms_summary([data / "sampler104_defaults.json", tmp_path / "lost.json",
                         data / "sampler103_gfill3_stamps.json", failed])
    lines = text.splitlines()
    assert lines[0].startswith("sampler104_defaults batch 1 {'step_ms': 2.12")
    assert "sampler104_defaults checks [{'batch': 1, 'tokens_equal': True, 'max_logprob_diff': 0.0}]" in lines
    assert any(line.startswith("lost: no results") for line in lines)
    gate_up = next(line for line in lines if line.strip().startswith("grouped 1536x2048"))
    assert "ctas 384.00" in gate_up and "exit 7.49" in gate_up
    assert "failed error {'shape': 'qwen3-8b', 'stage': 'build', 'error': 'OOM'}" in lines
    assert "failed profile batch 1 error RuntimeError('x')" in lines
    assert "failed chain batch 8 error RuntimeError('no kernel')" in lines
    assert "failed build 53.6 s: GPU 36.41 GiB after it, 38.20 GiB at its peak" in lines
    assert not any(" build " in line for line in lines if line.startswith("sampler104"))  # older records


def test_arms_summary_prints_the_replay_chain():
    """The thirtieth session's replay chain of the 30B (device_run92): the span a step, then each kernel's
    advance and duration per call with its calls a step, largest advance first (device_run92 printed it by
    hand)."""
    from pathlib import Path

    from fp4rl.benchmarks.sampler_gpu_report import arms_summary

    recorded = Path(__file__).parents[1] / "bench" / "data" / "s30" / "sampler92.json"
    lines = arms_summary([recorded]).splitlines()
    head = lines.index(next(x for x in lines if x.startswith("sampler92 chain batch 1 ")))
    assert "span 2135.2 us, busy 2122.7, idle 12.5 a step" in lines[head]
    assert lines[head + 1].split() == ["5.60", "us", "8.42", "us", "192", "w4a16_mma16"]
    assert lines[head + 2].split() == ["6.16", "us", "7.82", "us", "48", "_router_route_kernel"]
    assert any(x.startswith("sampler92 chain batch 8 span 4156.1 us") for x in lines)


def test_arms_summary_compares_the_arms_step_by_step():
    """The thirty-sixth session's three arms (device_run109): per batch each arm's step against the first
    (+7.8% for the Triton route at batch 1) and BF16's step over each NVFP4 arm's, from the unrounded steps
    (4.6578 / 1.9612 = 2.3750: 2.37x, not the 2.38x of the rounded figures); a batch only one arm ran is left
    out, and so is a row with an error."""
    import json
    from pathlib import Path

    from fp4rl.benchmarks.sampler_gpu_report import arms_summary, compare

    data = Path(__file__).parents[1] / "bench" / "data" / "s36"
    files = [data / f"sampler109_{arm}.json" for arm in ("router_cuda", "triton_route", "bf16")]
    lines = [x for x in arms_summary(files).splitlines() if " step ms: " in x]
    assert len(lines) == 4
    assert lines[0].startswith("qwen3-30b-a3b batch 1 step ms: sampler109_router_cuda 1.961, "
                               "sampler109_triton_route 2.115 (+7.8%), sampler109_bf16 4.658")
    assert lines[0].endswith("BF16 / arm: sampler109_router_cuda 2.37x, sampler109_triton_route 2.20x")
    assert lines[3].startswith("qwen3-30b-a3b batch 8 ") and "(-0.4%)" in lines[3] and "2.79x" in lines[3]
    rows = json.loads(files[0].read_text())["rows"]
    alone = compare({"a": rows[:1], "b": [dict(rows[0], batch=16), dict(rows[1], error="OOM")]})
    assert alone == [], alone


def test_each_nvfp4_arm_takes_the_bf16_arm_of_its_variant():
    """The forty-eighth session's device_run152: BF16 and the defaults each with the new attention tile and
    with FP4RL_ATTN_WIDE_TILE=128 (arms '*_t128'). Each NVFP4 arm's speedup is over the BF16 arm of the same
    variant: defaults_t128 6.805 / 4.317 = 1.58x against bf16_t128 (the first BF16 arm would give 1.54x); an
    arm with no BF16 twin takes the first BF16 arm."""
    from fp4rl.benchmarks.sampler_gpu_report import _variant, compare

    def row(step, preset="nvfp4-w4a16"):
        return [{"shape": "qwen3-8b", "batch": 32, "step_ms": step, "preset": preset,
                 "cadence_ms": [step] * 3}]

    arms = {"sampler152_8b_bf16": row(6.653, "bf16"), "sampler152_8b_bf16_t128": row(6.805, "bf16"),
            "sampler152_8b_defaults": row(4.178), "sampler152_8b_defaults_t128": row(4.317),
            "sampler152_8b_fill3": row(4.329)}
    names = list(arms)
    assert [_variant(n, names) for n in names] == ["", "t128", "", "t128", ""]
    assert _variant("s_a", ["s_a", "s_b"]) == "" and _variant("x_head_w", ["x_head_w", "x_bf16"]) == "w"
    line = compare(arms)[0]
    assert line.endswith("BF16 / arm: sampler152_8b_defaults 1.59x, sampler152_8b_defaults_t128 1.58x (vs "
                         "sampler152_8b_bf16_t128), sampler152_8b_fill3 1.54x"), line


def test_noisy_rows_are_flagged():
    # session 38's ROUTER_NORM arm on an H100: two generates at 1.23 and 1.83 ms a step around a 1.16 ms
    # graph replay; their median (the mean of two) read 1.53 ms, +26% against the defaults
    assert sampler_gpu_report.noisy(1.530, 1164.5, [1.227, 1.833])
    assert not sampler_gpu_report.noisy(1.218, 1152.8, [1.219, 1.217])  # the defaults' arm
    assert sampler_gpu_report.noisy(1.0, 1152.8, [1.0, 1.0])  # faster than its own replay
    assert not sampler_gpu_report.noisy(1.3, None, [1.3, 1.35])  # no replay (eager), cadences within 10%


def test_the_table_and_the_comparison_mark_a_noisy_row_from_its_cadences():
    """A recorded row is judged by its own cadences (its stored flag was computed by the older rule): the
    table puts * after its tok/s, the arms' comparison after its step."""
    row = {"shape": "qwen3-30b-a3b", "layers": 24, "full_layers": 48, "precision": "nvfp4-w4a16 all linears",
           "preset": "nvfp4-w4a16", "kv": "bf16", "batch": 1, "tok_s": 653.5, "step_ms": 1.530,
           "graph_us": 1164.5, "cadence_ms": [1.227, 1.833], "noisy": False}
    calm = dict(row, step_ms=1.218, tok_s=821.1, graph_us=1152.8, cadence_ms=[1.219, 1.217])
    table = sampler_gpu_report.markdown({"rows": [row], "profiles": []})
    assert "| 654* |" in table
    assert "| 821 |" in sampler_gpu_report.markdown({"rows": [calm], "profiles": []})
    line = sampler_gpu_report.compare({"defaults": [calm], "router_norm": [row]})[0]
    assert "defaults 1.218," in line and "router_norm 1.530* (+25.6%)" in line


@pytest.mark.parametrize("shape,params", [("qwen3-4b", 4_022_468_096), ("qwen3-8b", 8_190_735_360),
                                          ("qwen3-14b", 14_768_307_200), ("qwen3-30b-a3b", 30_532_122_624)])
def test_shapes_have_the_released_models_parameter_counts(shape, params):
    """The benchmark's random-weight models have the released checkpoints' parameter counts (their safetensors
    totals; Qwen3-4B ties its head to the embedding): a wrong width, head count or expert size shows here."""
    from fp4rl.model import CausalLM, ModelConfig

    with torch.device("meta"):
        model = CausalLM(ModelConfig(**sampler_gpu.SHAPES[shape]))
    model.tie_weights()
    assert sum(p.numel() for p in model.parameters()) == params

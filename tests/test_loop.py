"""The RL loop end to end on a tiny random model (configs/tiny.toml + a JSONL task): sync and
async (staleness bounded and recorded), a golden metrics trace, TRACE, and config errors.
Resuming and stopping runs (kill -9, Ctrl-C, --resume): tests/test_loop_resume.py.

Golden trace: tests/golden/tiny_sync.json holds the metrics of a fixed-seed tiny run. After an
intended change of the numbers (sampler, quantizer, loss...), regenerate it with
    FP4RL_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_loop.py -k golden
and say why in the commit.
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rl_fixtures import TINY_CONFIG as TINY
from rl_fixtures import run_tiny, tiny_assets, tiny_sets

from fp4rl.config import ConfigError, load_config
from fp4rl.loop import main, train
from fp4rl.metrics import read_metrics
from fp4rl.trainer import list_checkpoints

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden" / "tiny_sync.json"
GOLDEN_SETS = ["trainer.steps=4", "sampler.n=4", "eval.at_start=true", "task.eval_every=2",
               "trainer.lr=3e-3", "trainer.seed=1", "model.device=cpu"]  # CPU numbers, also on a GPU host
NON_DETERMINISTIC = ("time/", "memory/")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets"))


def deterministic(records):
    return [{k: v for k, v in r.items() if not k.startswith(NON_DETERMINISTIC)} for r in records]


def test_sync_run_logs_the_design_keys(assets, tmp_path):
    records = run_tiny(assets, tmp_path, "sync", "trainer.steps=3", "eval.at_start=true",
                       "eval.temperatures=[0.0, 1.0]")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert set(records[0]) >= {"eval/accuracy", "eval/accuracy_t1"} and records[0]["policy_version"] == 0
    for r in records[1:]:
        assert r["policy_version"] == r["step"]
        assert r["rollout/staleness_max"] == 0 and r["rollout/policy_version"] == r["step"] - 1
        keys = {"reward/mean", "reward/accuracy", "response/length_mean", "time/rollout_s", "time/train_s",
                "time/sync_s", "sync/bytes", "memory/peak_bytes", "eval/accuracy", "eval/accuracy_t1"}
        assert keys <= set(r), keys - set(r)
        assert r["sync/bytes"] > 0 and r["memory/peak_bytes"] > 0
        if r["train/sequences"]:
            assert {"mismatch/logprob_abs_diff", "mismatch/logprob_abs_diff_max", "mismatch/kl_k3",
                    "mismatch/tis_clip_frac", "train/grad_norm", "train/loss"} <= set(r)
            assert math.isfinite(r["mismatch/logprob_abs_diff"]) and r["mismatch/kl_k3"] >= 0
    assert any(r.get("train/sequences", 0) > 0 for r in records)
    run_dir = tmp_path / "sync"
    assert load_config(run_dir / "config.toml").trainer.steps == 3
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_000002", "step_000003"]  # keep 2
    assert (run_dir / "plots" / "reward.png").is_file()


def test_async_scores_in_the_trainers_thread_and_an_untrained_step_still_measures(assets, tmp_path):
    """An async run whose task has the JSONL default reward, math-verify (its timeouts use signal.alarm, which
    only works in the main thread: scored in the rollout thread, the first rollout failed). On the tiny
    model it scores 0 everywhere, so every group is dropped and no step trains: each step still logs the
    DESIGN keys, the mismatch measured on the whole rollout and a zero gradient."""
    prompts = tmp_path / "prompts.jsonl"  # an answer the tiny vocabulary (digits as words) cannot write
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1}", "answer": "1/7"}) + "\n"
                               for i in range(40)))
    sets = [s for s in tiny_sets(assets, tmp_path, "mv") if not s.startswith("task.kwargs=")]
    sets += [f"task.kwargs={{path = {json.dumps(str(prompts))}}}", "trainer.steps=2", "loop.mode=async",
             "loop.max_staleness=1", "task.eval_size=0"]
    records = train(load_config(TINY, sets))
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["reward/mean"] == 0.0 and r["train/sequences"] == 0
        assert r["train/grad_norm"] == 0.0 and r["train/loss"] == 0.0
        assert 0 < r["mismatch/logprob_abs_diff"] < 1 and r["mismatch/kl_k3"] >= 0
        assert "mismatch/tis_clip_frac" in r


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_in_process_weight_sync_hashes_nothing(assets, tmp_path, monkeypatch, mode):
    """The loop's samplers live in its process: its payloads are unsealed (build_payload(seal=False)), and no
    checksum is computed to build or load them (on an H200 the two hashing passes took 0.85 s of the default
    job's 1.29 s step, bench/RESULTS.md twenty-fifth session)."""
    from fp4rl import weight_sync
    hashed = []
    real = weight_sync.tensor_checksum
    monkeypatch.setattr(weight_sync, "tensor_checksum", lambda n, t: hashed.append(n) or real(n, t))
    sets = ["trainer.steps=2", "task.eval_every=1"] + (["loop.mode=async", "loop.max_staleness=1"]
                                                        if mode == "async" else [])
    records = run_tiny(assets, tmp_path, mode, *sets)
    assert [r["policy_version"] for r in records if r["step"] > 0] == [1, 2]
    assert all(r["time/sync_s"] >= 0 for r in records if r["step"] > 0)
    assert hashed == []


def test_a_bfloat16_sampler_is_a_config_key(assets, tmp_path):
    """sampler.dtype=bfloat16 samples in BF16 (the fast CPU path) while the master weights stay
    FP32: the run works and its sampler/trainer mismatch shows the BF16 rounding."""
    sets = ("trainer.steps=2", "task.eval_every=0", "precision.preset=\"nvfp4-w4a16\"")  # W4A16, FP32 trainer
    fp32 = run_tiny(assets, tmp_path, "fp32", *sets)
    bf16 = run_tiny(assets, tmp_path, "bf16", *sets, "sampler.dtype=bfloat16")
    diff = [r["mismatch/logprob_abs_diff"] for r in bf16 if "mismatch/logprob_abs_diff" in r]
    base = [r["mismatch/logprob_abs_diff"] for r in fp32 if "mismatch/logprob_abs_diff" in r]
    assert diff and base and all(math.isfinite(d) for d in diff)
    assert min(diff) > 2 * max(base)  # measured ~4x on this tiny model


def test_bfloat16_master_weights_warn_that_small_updates_round_away(assets, tmp_path):
    with pytest.warns(UserWarning, match="model.dtype = 'bfloat16'.*rounds away"):
        records = run_tiny(assets, tmp_path, "bf16_master", "trainer.steps=1", "task.eval_every=0",
                           "model.dtype=bfloat16")
    assert any("train/loss" in r for r in records)


@pytest.mark.parametrize("staleness", [1, 2])
def test_async_staleness_is_bounded_and_recorded(assets, tmp_path, staleness):
    records = run_tiny(assets, tmp_path, f"async{staleness}", "trainer.steps=5", "loop.mode=async",
                       f"loop.max_staleness={staleness}", "task.eval_every=0")
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    for r in steps:
        s = r["step"]
        assert r["rollout/policy_version"] == max(0, s - 1 - staleness)
        assert r["rollout/staleness_max"] == r["rollout/staleness_mean"] == min(s - 1, staleness)
        assert r["policy_version"] == s
    assert "eval/accuracy" in steps[-1] and "eval/accuracy" not in steps[0]
    # the same run again gives the same numbers: thread timing does not enter
    again = run_tiny(assets, tmp_path, f"async{staleness}-again", "trainer.steps=5", "loop.mode=async",
                     f"loop.max_staleness={staleness}", "task.eval_every=0")
    assert deterministic(again) == deterministic(records)


def test_generate_samples_a_run_in_its_precision(assets, tmp_path, monkeypatch, capsys):
    """`fp4rl generate --model RUN` (or one of its checkpoints): the run's newest weights, quantized as the
    run trained them (its config.toml's contract), the tokenizer of its model.name. Before, a run folder was
    "no config.json" and a checkpoint "no tokenizer", and one given a tokenizer sampled in BF16."""
    from rl_fixtures import record_sampler_modes

    from fp4rl.cli import main as cli

    run_tiny(assets, tmp_path, "gen", "trainer.steps=1", "precision.preset=nvfp4-linear")
    seen = record_sampler_modes(monkeypatch)
    run_dir = tmp_path / "gen"
    argv = ["generate", "--prompt", "w1 w2", "--max-new-tokens", "3", "--seed", "1"]
    capsys.readouterr()
    assert cli(argv + ["--model", str(run_dir)]) == 0
    first = capsys.readouterr()
    assert "step_000001: the run's weights in its precision (nvfp4-linear)" in first.err
    assert cli(argv + ["--model", str(run_dir / "checkpoints" / "step_000001")]) == 0
    assert capsys.readouterr().out == first.out  # the same weights, precision and seed
    assert cli(argv + ["--model", str(run_dir), "--precision", "bf16"]) == 0
    assert seen == [["w4a4"], ["w4a4"], []]
    for bad, says in ((["--greedy", "--temperature", "0.5"], "--temperature 0.5 would do nothing"),
                      (["--greedy", "--n", "2"], "2 identical completions")):
        with pytest.raises(SystemExit, match=says):
            cli(argv + ["--model", str(run_dir), *bad])


def test_a_plotting_failure_does_not_fail_a_finished_run(assets, tmp_path, monkeypatch):
    from fp4rl import loop

    def broken(run_dir):
        raise OSError("disk full")

    monkeypatch.setattr(loop, "plot", broken)
    with pytest.warns(UserWarning, match=r"plotting .* failed \(OSError: disk full\); the run is complete"):
        records = run_tiny(assets, tmp_path, "plotless", "trainer.steps=1")
    assert records[-1]["step"] == 1


def _close(a, b, rel, abs_tol):
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=rel, abs_tol=abs_tol)
    return a == b


def test_golden_trace(assets, tmp_path):
    """Rewards, eval accuracy, lengths and counts exactly; losses, norms and mismatch within 1e-3
    (relative): a change of the sampler, quantizer or loss that moves any sampled token shows."""
    records = deterministic(run_tiny(assets, tmp_path, "golden", *GOLDEN_SETS))
    if os.environ.get("FP4RL_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"config": "configs/tiny.toml + tests/rl_fixtures.py tiny model/task",
                                      "sets": GOLDEN_SETS, "records": records}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert golden["sets"] == GOLDEN_SETS
    assert [sorted(r) for r in records] == [sorted(r) for r in golden["records"]]
    exact = ("step", "policy_version", "reward/", "eval/", "response/", "rollout/", "train/sequences",
             "train/tokens", "sync/")
    for got, want in zip(records, golden["records"]):
        for key, value in want.items():
            if key.startswith(exact):
                assert got[key] == value, (got["step"], key)
            else:
                assert _close(got[key], value, 1e-3, 1e-6), (got["step"], key, got[key], value)
    assert any(r.get("train/sequences", 0) > 0 for r in records)


def test_config_errors_name_the_key(tmp_path, capsys, assets):
    assert main(["--set", "trainer.lr=-1"]) == 2
    assert "trainer.lr = -1.0: must be > 0" in capsys.readouterr().err
    assert main(["--set", "trainer.lrr=1"]) == 2
    assert "did you mean 'lr'" in capsys.readouterr().err
    assert main(["--resume", str(tmp_path / "nope")]) == 2
    assert "no config.toml" in capsys.readouterr().err
    assert main(["--resume", str(tmp_path), "--config", str(TINY)]) == 2
    assert "--resume RUN_DIR reads RUN_DIR/config.toml" in capsys.readouterr().err
    assert main(["--help-config"]) == 0
    assert "trainer.checkpoint_keep" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="precision.trace"):  # TRACE guides W4A4 linears: W4A16 has none
        run_tiny(assets, tmp_path, "trace", "precision.trace=true", "precision.preset=nvfp4-w4a16")
    assert main(["--config", str(TINY), *sum((["--set", x] for x in tiny_sets(
        assets, tmp_path, "trace", "precision.trace=true", "precision.preset=nvfp4-w4a16")), [])]) == 2
    assert "precision.trace" in capsys.readouterr().err
    # rules that make no dense linear W4A4 (TRACE would guide nothing): refused at load time, or once the
    # model is converted when a W4A4 rule matches no dense linear; before any file is written either way
    with pytest.raises(ConfigError, match="precision.trace"):
        run_tiny(assets, tmp_path, "trace_rules", "precision.trace=true", "precision.preset=nvfp4-w4a16",
                 'precision.rules={"lm_head" = "bf16"}')
    # (the tiny model ties lm_head to its embeddings: its only linear a rule could make W4A4 here is refused
    # as such, by the contract, before the TRACE check)
    with pytest.raises(ValueError, match=r"lm_head resolves to w4a4 but is tied to embed_tokens"):
        run_tiny(assets, tmp_path, "trace_rules", "precision.trace=true", "precision.preset=nvfp4-w4a16",
                 'precision.rules={"lm_head" = "w4a4"}')
    assert not (tmp_path / "trace_rules").exists()
    if not torch.cuda.is_available():  # a CUDA device asked for where there is none: named before loading
        with pytest.raises(ConfigError, match="model.device = 'cuda' but torch sees no CUDA device"):
            run_tiny(assets, tmp_path, "cuda", "model.device=cuda")
    try:
        import wandb  # noqa: F401
    except ImportError:  # wandb asked for, not installed: named before loading (a traceback after it)
        with pytest.raises(ConfigError, match="logging.wandb = true but wandb is not installed"):
            run_tiny(assets, tmp_path, "wandb", "logging.wandb=true")
        assert not (tmp_path / "wandb").exists()
    with pytest.raises(ValueError, match="sampler.temperature"):
        run_tiny(assets, tmp_path, "greedy", "sampler.temperature=0")
    for key in ("sampler.max_new_tokens", "eval.max_new_tokens"):  # before the step-0 eval, naming the key
        with pytest.raises(ConfigError, match=f"{key} = 100000 leaves no room for a prompt .*lower {key}"):
            run_tiny(assets, tmp_path, "long", f"{key}=100000", "eval.at_start=true")
        assert not (tmp_path / "long" / "metrics.jsonl").exists()
    run_tiny(assets, tmp_path, "twice", "trainer.steps=1")
    with pytest.raises(FileExistsError, match="--resume"):
        run_tiny(assets, tmp_path, "twice", "trainer.steps=1")
    capsys.readouterr()
    assert main(["--config", str(TINY), *sum((["--set", x] for x in tiny_sets(
        assets, tmp_path, "twice", "trainer.steps=1")), [])]) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.slow
def test_default_job_learns_beyond_the_seed_spread(tmp_path):
    """`make run`'s config, three seeds side by side (one torch thread each): held-out greedy
    accuracy after training beats the accuracy before by more than the spread between seeds.
    Run with: .venv/bin/python -m pytest -m slow tests/test_loop.py -k default_job -s"""
    seeds = (0, 1, 2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    start = time.monotonic()
    for seed in seeds:
        argv = [sys.executable, "-m", "fp4rl.loop", "--config", str(ROOT / "configs" / "default.toml"),
                "--set", f"run.dir={json.dumps(str(tmp_path))}", "--set", f"run.name=s{seed}",
                "--set", f"trainer.seed={seed}", "--set", "logging.progress=false"]
        log = open(tmp_path / f"s{seed}.log", "w")  # noqa: SIM115 (closed with the process)
        procs[seed] = (subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    for seed, (proc, log) in procs.items():
        code = proc.wait()
        log.close()
        assert code == 0, (tmp_path / f"s{seed}.log").read_text()[-3000:]
    before, after = {}, {}
    for seed in seeds:
        evals = [r for r in read_metrics(tmp_path / f"s{seed}") if "eval/accuracy" in r]
        before[seed], after[seed] = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
        print(f"seed {seed}: held-out greedy accuracy {before[seed]:.2f} -> {after[seed]:.2f}")
    print(f"{len(seeds)} runs side by side: {(time.monotonic() - start) / 60:.1f} min")
    spread = max(after.values()) - min(after.values())
    assert len(set(before.values())) == 1  # greedy decoding of one initial model: seed-independent
    assert min(after[s] - before[s] for s in seeds) > spread, (before, after)


def test_trace_guides_the_trainer_towards_the_samplers_codes(assets, tmp_path):
    """TRACE on the tiny W4A4 job: the same first rollout (same weights, same seed) scored with and
    without guided rounding; the guided trainer reproduces the sampler's codes in the guided layers and
    its logprobs come much closer to the sampler's. The guidance of a checkpointed rollout (async mode's
    pending ones) survives the checkpoint's plain-data round trip."""
    from fp4rl.rollout import Rollout
    from fp4rl.tasks import task_from_config

    plain = run_tiny(assets, tmp_path, "plain", "trainer.steps=2")
    guided = run_tiny(assets, tmp_path, "guided", "trainer.steps=2", "precision.trace=true")
    for r in guided:
        assert {"trace/code_disagree_rtn", "trace/code_disagree_guided",
                "trace/cache_bytes_per_token"} <= set(r)
        assert 0 < r["trace/code_disagree_rtn"] < 1  # some round-to-nearest codes changed, not all
        assert 0 <= r["trace/code_disagree_guided"] < r["trace/code_disagree_rtn"]
        assert r["trace/cache_bytes_per_token"] > 0
    # every W4A4 layer guided (the default): 0.002 vs 0.11 on this job
    assert guided[0]["mismatch/logprob_abs_diff"] < 0.1 * plain[0]["mismatch/logprob_abs_diff"]
    deep = run_tiny(assets, tmp_path, "deep", "trainer.steps=1", "precision.trace=true",
                    "precision.trace_deep_fraction=0.5")  # the deep half only: fewer bytes, less effect
    assert deep[0]["trace/cache_bytes_per_token"] < guided[0]["trace/cache_bytes_per_token"]
    assert guided[0]["mismatch/logprob_abs_diff"] < deep[0]["mismatch/logprob_abs_diff"] < plain[0][
        "mismatch/logprob_abs_diff"]
    assert "trace/code_disagree_rtn" not in plain[0]

    from fp4rl.hf import load_model
    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import convert
    from fp4rl.sampler import Sampler, SamplingParams

    config = load_config(TINY, tiny_sets(assets, tmp_path, "rt", "precision.trace=true"))
    task = task_from_config(config.task)
    model, _ = load_model(config.model.name)
    sampler = Sampler(convert(model, PrecisionContract("nvfp4-linear")), eos_token_ids=[])
    prompts = task.batch(0, 2)
    completions = sampler.generate([[5, 6, 7], [8, 9]],
                                   SamplingParams(n=2, max_new_tokens=4, guidance=1.0, seed=0))
    for c in completions:
        assert c.guidance and all(g["amax"].shape[0] == len(c.prompt_ids) + len(c.completion_ids) - 1
                                  for g in c.guidance.values())
    back = Rollout.from_state_dict(Rollout(1, prompts, completions, None, 0.0).state_dict(), task, 2)
    for a, b in zip(completions, back.completions):
        assert a.guidance.keys() == b.guidance.keys()
        for k in a.guidance:
            for f in ("bits", "block_scale", "amax"):
                x, y = a.guidance[k][f], b.guidance[k][f]
                assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_trace_guides_the_routed_experts_of_the_recipe(tmp_path):
    """TRACE on an MoE model under the recipe's preset (nvfp4-experts: the routed experts are its only W4A4
    linears): the job runs, logs the guidance counters, and the guided trainer scores the rollout closer
    to the sampler than the unguided one."""
    from rl_fixtures import save_tiny_model, write_prompts

    assets = (save_tiny_model(tmp_path / "moe_model", moe=True), write_prompts(tmp_path / "prompts.jsonl"))
    sets = ("trainer.steps=1", "precision.preset=nvfp4-experts", "precision.bf16_last_fraction=0.0")
    plain = run_tiny(assets, tmp_path, "moe_plain", *sets)
    guided = run_tiny(assets, tmp_path, "moe_guided", *sets, "precision.trace=true")
    r = guided[-1]
    assert r["trace/cache_bytes_per_token"] > 0 and 0 <= r["trace/code_disagree_rtn"] < 1
    assert "trace/code_disagree_rtn" not in plain[-1]
    # 0.0049 vs 0.033 on this job (k3 KL 2.6e-5 vs 1.3e-3)
    assert r["mismatch/logprob_abs_diff"] < 0.3 * plain[-1]["mismatch/logprob_abs_diff"], (r, plain[-1])
    # rules that quantize one layer's experts unalike: refused before any rollout, naming the fix
    with pytest.raises(ConfigError, match="every expert of a layer must quantize"):
        run_tiny(assets, tmp_path, "moe_mixed", "trainer.steps=1", "precision.preset=nvfp4-w4a16",
                 'precision.rules={"*.experts.0.*" = "w4a4"}', "precision.trace=true")

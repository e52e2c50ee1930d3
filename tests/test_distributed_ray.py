"""fp4rl.distributed.ray_pool (Ray sampler actors) and the [distributed] section of `fp4rl train`.

One Ray session for the whole module (starting Ray takes seconds), in a short temp dir under /tmp (Ray's
Unix socket paths must stay under 108 characters). A test that needs Ray fails if Ray cannot start.
"""

import functools
import operator
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import rl_fixtures
import torch
from rl_fixtures import optimizer_step, tiny_assets, tiny_sets

from fp4rl.config import ConfigError, load_config
from fp4rl.distributed import LocalShards
from fp4rl.model import CausalLM, ModelConfig
from fp4rl.precision import PrecisionContract
from fp4rl.qat import convert
from fp4rl.sampler import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
NON_DETERMINISTIC = ("time/", "memory/")
CFG = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, qk_norm=True)
PROMPTS = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11]]


@pytest.fixture(scope="module")
def ray_session():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tempfile.mkdtemp(prefix="fp4rl-ray-", dir="/tmp")  # short: socket paths < 108 chars
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def tiny_converted():
    torch.manual_seed(0)
    contract = PrecisionContract("nvfp4-w4a16")
    return convert(CausalLM(ModelConfig(**CFG)).eval(), contract), contract


@pytest.fixture(scope="module")
def pool_and_model(ray_session):
    from fp4rl.distributed.ray_pool import RayRolloutPool, SamplerFactory

    model, contract = tiny_converted()
    factory = SamplerFactory(model, eos_token_ids=[])
    with RayRolloutPool(factory, 2, torch_threads=torch.get_num_threads()) as pool:
        yield pool, factory, model, contract


def test_pool_generates_what_local_shards_do(pool_and_model):
    pool, factory, _, _ = pool_and_model
    local = LocalShards(factory(), 2)
    assert pool.policy_version == local.policy_version == 0 and len(set(pool.pids)) == 2
    for prompts, params in [(PROMPTS, SamplingParams(n=3, seed=11, max_new_tokens=6)),
                            (PROMPTS[:4], SamplingParams(n=2, seed=5, max_new_tokens=5, top_k=20, top_p=0.9)),
                            (PROMPTS[:1], SamplingParams(n=2, seed=3, max_new_tokens=4)),  # shard 1 empty
                            (PROMPTS, SamplingParams(n=1, greedy=True, max_new_tokens=6))]:
        got = pool.generate(prompts, params)
        want = local.generate(prompts, params)
        assert got == want  # every field: tokens, logprobs (exact floats), text, prompt_index, versions
        n = params.n
        assert [c.prompt_index for c in got] == [i for i in range(len(prompts)) for _ in range(n)]
        assert [c.sample_index for c in got] == list(range(n)) * len(prompts)
        assert [c.prompt_ids for c in got[::n]] == prompts
        assert {c.policy_version for c in got} == {0}
    # the second shard sampled with its own seed: not the single sampler's completions
    params = SamplingParams(n=3, seed=11, max_new_tokens=6)
    assert pool.generate(PROMPTS, params) != factory().generate(PROMPTS, params)


def test_an_actor_failure_names_the_actor(pool_and_model):
    from fp4rl.distributed.ray_pool import SamplerActorError

    pool, _, _, _ = pool_and_model
    bad = [[1, 2], [3], [4, 500]]  # the last prompt (shard 1: prompts 2..3) has a token outside the vocab
    match = r"sampler actor 1 of 2 failed in generate.*outside \[0, 96\)"
    with pytest.raises(SamplerActorError, match=match) as info:
        pool.generate(bad, SamplingParams(n=1, seed=0, max_new_tokens=2))
    assert info.value.index == 1
    assert pool.generate(PROMPTS[:2], SamplingParams(n=1, seed=0, max_new_tokens=2))  # the pool still works


def _wait_until_dead(ray, actor, timeout_s: float = 60.0) -> None:
    """Block until calls to a killed actor fail (a call sent before the kill lands could still run: the test
    would then see a live actor, a race that failed once in a full local run)."""
    from ray.exceptions import GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ready.remote(), timeout=10)
        except RayActorError:
            return
        except GetTimeoutError:
            continue
        time.sleep(0.05)
    pytest.fail(f"the killed actor still answers after {timeout_s} s")


def test_a_dead_actor_stops_the_pool(ray_session):
    """An actor that died is named when its result is due, and the pool then refuses to generate (running
    the live shards again could only fail the same way) until it is rebuilt."""
    from fp4rl.distributed.ray_pool import RayRolloutPool, SamplerActorError, SamplerFactory

    model, _ = tiny_converted()
    with RayRolloutPool(SamplerFactory(model, eos_token_ids=[]), 2, torch_threads=1) as pool:
        params = SamplingParams(n=1, seed=0, max_new_tokens=2)
        assert pool.generate(PROMPTS, params)
        ray_session.kill(pool._actors[1])
        _wait_until_dead(ray_session, pool._actors[1])  # ray.kill returns before the actor is gone
        with pytest.raises(SamplerActorError, match=r"sampler actor 1 of 2 failed in generate") as info:
            pool.generate(PROMPTS, params)
        assert info.value.index == 1
        with pytest.raises(RuntimeError, match=r"sampler actor 1 died .*build a new one"):
            pool.generate(PROMPTS, params)


def test_a_failing_factory_names_the_actor(ray_session):
    from fp4rl.distributed.ray_pool import RayRolloutPool, SamplerActorError

    match = "(?s)sampler actor [01] of 2 failed in startup.*ZeroDivisionError"  # whichever fails first
    with pytest.raises(SamplerActorError, match=match):
        RayRolloutPool(functools.partial(operator.truediv, 1, 0), 2, startup_timeout_s=60)
    with pytest.raises(TypeError, match="cannot be pickled.*SamplerFactory"):
        RayRolloutPool(functools.partial(print, threading.Lock()), 1)


def test_load_moves_every_actor_to_the_payload(pool_and_model):
    """Runs after the generation tests: the module's pool is at version 1 afterwards."""
    from fp4rl.distributed.ray_pool import SamplerActorError
    from fp4rl.weight_sync import build_payload

    pool, factory, model, contract = pool_and_model
    old = build_payload(model, contract, 0)
    trained = tiny_converted()[0]
    optimizer_step(trained)
    payload = build_payload(trained, contract, 1)
    pool.load(payload, verify=True)  # every actor re-hashes its tensors against the payload's checksums
    assert pool.policy_version == 1
    local = factory()
    local.load(payload, verify=True)
    params = SamplingParams(n=2, seed=7, max_new_tokens=6)
    got = pool.generate(PROMPTS, params)
    assert got == LocalShards(local, 2).generate(PROMPTS, params)
    assert {c.policy_version for c in got} == {1}
    before = factory()
    assert got != LocalShards(before, 2).generate(PROMPTS, params), "the new weights sample differently"
    assert pool.sampler_attr("policy_version") == [1, 1]
    with pytest.raises(SamplerActorError, match="sampler actor [01] of 2 failed in load.*older than"):
        pool.load(old)  # stale: refused by every actor, the pool keeps version 1
    assert pool.policy_version == 1
    with pytest.raises(TypeError, match="weight_sync.Payload"):
        pool.load(b"bytes")


def test_a_load_that_leaves_mixed_versions_stops_the_pool(pool_and_model):
    """Runs after test_load_moves_every_actor_to_the_payload (the module's pool at v1): actor 0 alone is
    moved to v2 behind the pool's back, so loading v1 fails on actor 0 only and the actors then hold v2 and
    v1; the pool refuses to sample until a payload every actor accepts (v2) is loaded."""
    from fp4rl.distributed.ray_pool import SamplerActorError
    from fp4rl.weight_sync import build_payload

    pool, _, _, contract = pool_and_model
    assert pool.policy_version == 1
    trained = tiny_converted()[0]
    optimizer_step(trained)
    v1 = build_payload(trained, contract, 1)
    optimizer_step(trained)
    v2 = build_payload(trained, contract, 2)
    ray = pool._ray
    ray.get(pool._actors[0].load.remote(ray.put(v2.to_bytes()), False))
    with pytest.raises(SamplerActorError, match="actor 0 of 2 failed in load"):
        pool.load(v1)
    with pytest.raises(RuntimeError, match=r"left the actors at versions \[2, 1\]"):
        pool.generate(PROMPTS, SamplingParams(n=1, seed=0, max_new_tokens=2))
    pool.load(v2)
    assert pool.policy_version == 2 and pool.sampler_attr("policy_version") == [2, 2]
    assert pool.generate(PROMPTS[:2], SamplingParams(n=1, seed=0, max_new_tokens=2))


def test_a_local_session_without_the_gpus_is_refused_at_once(tmp_path):
    """A pool that starts its own Ray session (one machine, no autoscaler) checks the GPUs it asks for
    before starting actors (instead of waiting startup_timeout_s for resources that never come)."""
    import subprocess

    temp = tempfile.mkdtemp(prefix="fp4rl-ray2-", dir="/tmp")
    code = (
        "import os; os.environ.setdefault('RAY_AUTH_MODE', 'disabled')\n"
        "from fp4rl.distributed.ray_pool import RayRolloutPool\n"
        "try:\n"
        f"    RayRolloutPool(print, 2, gpus_per_sampler=1, ray_init_kwargs=dict(num_cpus=1, num_gpus=0, "
        f"include_dashboard=False, _temp_dir={temp!r}, log_to_driver=False))\n"
        "except ValueError as e:\n"
        "    print('REFUSED', e)\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             cwd=ROOT, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert "REFUSED" in out.stdout, out.stderr[-2000:]
    assert "need 2 GPUs" in out.stdout and "has 0" in out.stdout


def test_pool_arguments_and_missing_ray(monkeypatch):
    from fp4rl.distributed import ray_pool

    with pytest.raises(ValueError, match="num_samplers"):
        ray_pool.RayRolloutPool(lambda: None, 0)
    with pytest.raises(ValueError, match="gpus_per_sampler"):
        ray_pool.RayRolloutPool(lambda: None, 1, gpus_per_sampler=-1)
    with pytest.raises(TypeError, match="callable"):
        ray_pool.RayRolloutPool("sampler", 1)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ImportError, match=r"pip install 'fp4rl\[dist\]'"):
        ray_pool.RayRolloutPool(lambda: None, 2)


# ---------------------------------------------------------------------------------- fp4rl train


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets"))


def run_tiny(assets, tmp_path, name, *sets):
    return rl_fixtures.run_tiny(assets, tmp_path, name, "model.device=cpu", *sets)


def deterministic(records):
    return [{k: v for k, v in r.items() if not k.startswith(NON_DETERMINISTIC)} for r in records]


def final_weights(run_dir):
    from fp4rl.hf import load_state_dict
    from fp4rl.trainer import list_checkpoints

    return load_state_dict(list_checkpoints(run_dir)[-1])


def assert_same_weights(a, b):
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


RUN = ("trainer.steps=2", "sampler.n=3", "task.prompts_per_step=3", "eval.at_start=true", "task.eval_every=1",
       "eval.temperatures=[0.0, 1.0]", "trainer.lr=3e-3")


def test_train_on_ray_equals_local_shards(ray_session, assets, tmp_path):
    """distributed.backend = ray with 2 samplers: the metrics (but time/*, memory/*) and final weights of
    the same run with backend local and 2 samplers; the pool's actors are gone afterwards."""
    local = run_tiny(assets, tmp_path, "local", *RUN, "distributed.samplers=2")
    on_ray = run_tiny(assets, tmp_path, "ray", *RUN, "distributed.backend=ray", "distributed.samplers=2")
    assert [r["step"] for r in on_ray] == [0, 1, 2]
    assert deterministic(on_ray) == deterministic(local)
    assert any(r.get("train/sequences", 0) > 0 for r in on_ray)
    assert_same_weights(tmp_path / "ray", tmp_path / "local")
    assert load_config(tmp_path / "ray" / "config.toml").distributed.backend == "ray"


def test_async_train_on_ray_and_resume(ray_session, assets, tmp_path):
    """Async (the rollout thread drives the pool), resumed with more steps: equal to one local run."""
    from fp4rl.loop import main

    sets = ("loop.mode=async", "loop.max_staleness=1", "trainer.checkpoint_every=1", "task.eval_every=2",
            "distributed.samplers=2")
    full = run_tiny(assets, tmp_path, "local", *sets, "trainer.steps=3")
    run_tiny(assets, tmp_path, "ray", *sets, "trainer.steps=2", "distributed.backend=ray")
    assert main(["--resume", str(tmp_path / "ray"), "--set", "trainer.steps=3"]) == 0
    from fp4rl.metrics import read_metrics

    resumed = read_metrics(tmp_path / "ray")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert deterministic(resumed) == deterministic(full)
    assert [r["rollout/staleness_max"] for r in resumed] == [0, 1, 1]
    assert_same_weights(tmp_path / "ray", tmp_path / "local")


def test_the_pool_is_shut_down_when_train_fails(ray_session, assets, tmp_path, monkeypatch):
    from fp4rl import loop
    from fp4rl.distributed import ray_pool

    pools = []

    class Recorded(ray_pool.RayRolloutPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(self)

    def fail(*args, **kwargs):
        raise RuntimeError("boom in make_batch")

    monkeypatch.setattr(ray_pool, "RayRolloutPool", Recorded)
    monkeypatch.setattr(loop, "make_batch", fail)
    with pytest.raises(RuntimeError, match="boom in make_batch"):
        run_tiny(assets, tmp_path, "fails", "distributed.backend=ray", "distributed.samplers=2",
                 "trainer.steps=1")
    (pool,) = pools
    with pytest.raises(RuntimeError, match="shut down"):
        pool.generate(PROMPTS, SamplingParams(n=1, seed=0, max_new_tokens=2))
    assert ray_session.is_initialized(), "a pool that did not start Ray leaves it running"
    deadline = time.monotonic() + 30  # the actors' processes are gone (killed, not just forgotten)
    alive = list(pool.pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _alive(pid)]
        time.sleep(0.2)
    assert not alive, f"sampler actor processes {alive} still run after the pool shut down"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by the raylet) counts as gone
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_local_shards_in_train_is_reproducible(assets, tmp_path):
    """backend local, 2 samplers, sync: two runs give the same metrics and weights; they differ from the
    run with 1 sampler (the second shard samples with its own seed)."""
    one = run_tiny(assets, tmp_path, "one", *RUN)
    two = run_tiny(assets, tmp_path, "two", *RUN, "distributed.samplers=2")
    again = run_tiny(assets, tmp_path, "again", *RUN, "distributed.samplers=2")
    assert deterministic(two) == deterministic(again)
    assert_same_weights(tmp_path / "two", tmp_path / "again")
    assert deterministic(two) != deterministic(one)
    assert [r["step"] for r in two] == [0, 1, 2]
    assert [r["reward/mean"] for r in two[1:]] != [r["reward/mean"] for r in one[1:]] or \
        [r["response/length_mean"] for r in two[1:]] != [r["response/length_mean"] for r in one[1:]]


def test_distributed_config_errors(assets, tmp_path, monkeypatch):
    from fp4rl.loop import check_distributed, main

    with pytest.raises(ConfigError, match="distributed.samplers = 0: must be >= 1"):
        load_config(None, ["distributed.samplers=0"])
    with pytest.raises(ConfigError, match="distributed.backend = 'mpi': allowed values are 'local', 'ray'"):
        load_config(None, ["distributed.backend=mpi"])
    with pytest.raises(ConfigError, match="distributed.gpus_per_sampler = -1.0: must be >= 0"):
        load_config(None, ["distributed.backend=ray", "distributed.gpus_per_sampler=-1"])
    with pytest.raises(ConfigError, match=r"gpus_per_sampler = 1.5: Ray gives an actor a fraction"):
        load_config(None, ["distributed.backend=ray", "distributed.gpus_per_sampler=1.5"])
    with pytest.raises(ConfigError, match=r"gpus_per_sampler = 1 is for Ray actors: set distributed.backend"):
        load_config(None, ["distributed.gpus_per_sampler=1"])
    ray_cfg = load_config(None, ["distributed.backend=ray"])
    with pytest.raises(ConfigError, match="distributed.gpus_per_sampler = 1 \\(or a fraction"):
        check_distributed(ray_cfg, "cuda")
    with pytest.raises(ConfigError, match="the run samples on cpu.*gpus_per_sampler = 0"):
        check_distributed(load_config(None, ["distributed.backend=ray", "distributed.gpus_per_sampler=1"]),
                          "cpu")
    check_distributed(ray_cfg, "cpu")
    # Ray missing: a config error naming the key and the install command, before any model is loaded
    monkeypatch.setattr("fp4rl.config._module_available", lambda name: name != "ray")
    with pytest.raises(ConfigError, match=r"backend = \"ray\" needs Ray.*pip install 'fp4rl\[dist\]'"):
        check_distributed(ray_cfg, "cpu")
    argv = ["--config", str(rl_fixtures.TINY_CONFIG)]
    for item in tiny_sets(assets, tmp_path, "noray", "distributed.backend=ray"):
        argv += ["--set", item]
    assert main(argv) == 2
    assert not (tmp_path / "noray").exists()


def test_trace_guidance_travels_from_the_actors(ray_session):
    """TRACE completions carry float8 block scales, which plain pickling (Ray's results) cannot carry: the
    actors send them through fp4rl.distributed.wire, and they arrive with their dtypes and bytes."""
    from fp4rl.distributed.ray_pool import RayRolloutPool, SamplerFactory

    torch.manual_seed(1)
    contract = PrecisionContract("nvfp4-linear", bf16_last_fraction=0.0)
    model = convert(CausalLM(ModelConfig(**CFG)).eval(), contract)
    factory = SamplerFactory(model, eos_token_ids=[])
    params = SamplingParams(n=2, seed=4, max_new_tokens=4, guidance=1.0)
    with RayRolloutPool(factory, 2, torch_threads=torch.get_num_threads()) as pool:
        got = pool.generate(PROMPTS[:3], params)
    want = LocalShards(factory(), 2).generate(PROMPTS[:3], params)
    assert len(got) == len(want) == 6
    dtypes = set()
    for g, w in zip(got, want):
        assert (g.prompt_index, g.completion_ids) == (w.prompt_index, w.completion_ids)
        assert g.logprobs == w.logprobs
        assert g.guidance and g.guidance.keys() == w.guidance.keys()
        for key, parts in w.guidance.items():
            assert parts.keys() == g.guidance[key].keys()
            for name, t in parts.items():
                dtypes.add(t.dtype)
                assert g.guidance[key][name].dtype == t.dtype and torch.equal(
                    g.guidance[key][name].view(torch.uint8), t.view(torch.uint8))
    assert torch.float8_e4m3fn in dtypes, "the test must carry the float8 block scales"


def test_actors_built_from_the_config_sample_what_the_trainer_copy_does(ray_session):
    """SamplerFactory(model, contract=...) ships only the config (the RL loop's choice): each actor builds
    the model with zero weights, the first payload fills every tensor, and the pool then samples exactly
    what a sampler built from the model itself does."""
    import pickle

    from fp4rl.distributed.ray_pool import RayRolloutPool, SamplerFactory
    from fp4rl.weight_sync import build_payload

    model, contract = tiny_converted()
    optimizer_step(model)
    payload = build_payload(model, contract, 1)
    light = SamplerFactory(model, contract=contract, eos_token_ids=[])
    heavy = SamplerFactory(model, eos_token_ids=[])
    assert len(pickle.dumps(light)) * 4 < len(pickle.dumps(heavy)), "the config factory must not ship weights"
    params = SamplingParams(n=2, seed=9, max_new_tokens=6)
    with RayRolloutPool(light, 2, torch_threads=torch.get_num_threads()) as pool:
        pool.load(payload, verify=True)
        got = pool.generate(PROMPTS, params)
    local = heavy()
    local.load(payload, verify=True)
    assert got == LocalShards(local, 2).generate(PROMPTS, params)
    empty = pickle.loads(pickle.dumps(light))()  # what an actor holds before its first payload
    assert all(float(p.abs().sum()) == 0 for p in empty.model.parameters() if p.is_floating_point())


@pytest.mark.gpu
def test_gpu_pool_matches_local_shards(ray_session):
    """CUDA sampler actors (half a GPU each, the decode kernels and CUDA graphs of the sampler) built from the
    config, loaded with a payload: the same completions as LocalShards of a CUDA sampler in this process."""
    from fp4rl.distributed.ray_pool import RayRolloutPool, SamplerFactory
    from fp4rl.weight_sync import build_payload

    model, contract = tiny_converted()
    optimizer_step(model)
    payload = build_payload(model, contract, 1)
    kwargs = dict(eos_token_ids=[], device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(n=2, seed=5, max_new_tokens=6)
    with RayRolloutPool(SamplerFactory(model, contract=contract, **kwargs), 2, gpus_per_sampler=0.5) as pool:
        pool.load(payload, verify=True)
        got = pool.generate(PROMPTS, params)
        assert pool.sampler_attr("device") == [torch.device("cuda")] * 2
    local = SamplerFactory(model, **kwargs)()
    local.load(payload, verify=True)
    assert got == LocalShards(local, 2).generate(PROMPTS, params)


def test_a_config_built_sampler_holds_its_zeros_in_the_samplers_dtype():
    """A bfloat16 sampler built from the config (an actor's, before its first payload) makes its zero model
    in bfloat16, not the fp32 master dtype (half the host memory per actor), and once loaded samples what a
    sampler built from the model itself does."""
    import pickle

    from fp4rl.distributed.ray_pool import SamplerFactory
    from fp4rl.weight_sync import build_payload

    model, contract = tiny_converted()
    optimizer_step(model)
    assert next(model.parameters()).dtype == torch.float32
    kwargs = dict(eos_token_ids=[], dtype=torch.bfloat16)
    factory = pickle.loads(pickle.dumps(SamplerFactory(model, contract=contract, **kwargs)))
    built = []
    real_empty = factory._empty_model
    factory._empty_model = lambda: built.append(real_empty()) or built[-1]
    light = factory()
    assert {p.dtype for p in built[0].parameters() if p.is_floating_point()} == {torch.bfloat16}
    heavy = SamplerFactory(model, **kwargs)()
    payload = build_payload(model, contract, 1)
    light.load(payload, verify=True)
    heavy.load(payload, verify=True)
    params = SamplingParams(n=2, seed=4, max_new_tokens=6)
    assert light.generate(PROMPTS, params) == heavy.generate(PROMPTS, params)


def test_a_sampler_built_from_the_config_refuses_to_sample_before_its_first_payload():
    """The config factory's sampler holds zero weights whatever policy_version its settings name: it refuses
    to generate (a zero model's completions would carry that version) until a payload is loaded."""
    import pickle

    from fp4rl.distributed.ray_pool import SamplerFactory
    from fp4rl.weight_sync import build_payload

    model, contract = tiny_converted()
    empty = pickle.loads(pickle.dumps(SamplerFactory(model, contract=contract, eos_token_ids=[],
                                                     policy_version=3)))()
    params = SamplingParams(n=1, seed=1, max_new_tokens=3)
    with pytest.raises(RuntimeError, match="no weights loaded yet"):
        empty.generate(PROMPTS, params)
    empty.load(build_payload(model, contract, 4), verify=True)
    assert [c.policy_version for c in empty.generate(PROMPTS, params)] == [4] * len(PROMPTS)

"""fp4rl.distributed.torch_dist: payload broadcast, sharded rollouts, weight sync and gradient averaging over
2 gloo ranks (spawned processes, file:// rendezvous in tmp_path). Each rank writes its results to tmp_path;
the parent asserts. Hangs fail: the collectives time out and the parent kills ranks that outlive the join."""

import dataclasses
import hashlib
import multiprocessing as mp
import os
import pickle
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from rl_fixtures import converted_model, optimizer_step

from fp4rl.distributed import LocalShards
from fp4rl.distributed import torch_dist as td
from fp4rl.model import CausalLM, ModelConfig
from fp4rl.precision import PrecisionContract
from fp4rl.qat import convert
from fp4rl.sampler import Completion, Sampler, SamplingParams
from fp4rl.weight_sync import Payload, build_payload, verify_equal

MOE = dict(model_type="qwen3_moe", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, qk_norm=True,
           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
DENSE = dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
             tie_word_embeddings=True)
PROMPTS = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11]]
PARAMS = SamplingParams(n=2, seed=11, max_new_tokens=4)
GREEDY = SamplingParams(greedy=True, max_new_tokens=5)
WORLD = 2


def moe_sampler():
    torch.manual_seed(0)
    model = convert(CausalLM(ModelConfig(**MOE)).eval(), PrecisionContract("nvfp4-w4a16"))
    return Sampler(model, eos_token_ids=[])


def weights_digest(sampler) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(sampler.model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def raises(fn, *args, **kwargs) -> str:
    """`type: message` of what fn raised (a rank records it for the parent), or '' if it returned."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


# ----------------------------------------------------------------------------------------------
# Rank programs (run in spawned processes; return what the parent checks)


def rank_broadcast(rank: int) -> dict:
    model, contract = converted_model(DENSE, "nvfp4-linear")
    optimizer_step(model)
    payload = build_payload(model, contract, version=3)
    got = td.broadcast_payload(payload if rank == 0 else None)
    out = dict(blob=got.to_bytes(), digest=got.digest, same_object=got is payload)
    out["src_none"] = raises(td.broadcast_payload, None)  # src passes nothing: every rank raises
    with warnings.catch_warnings(record=True) as caught:  # both pass one, src=1: rank 0's is ignored
        warnings.simplefilter("always")
        other = build_payload(model, contract, version=4 + rank)
        got1 = td.broadcast_payload(other, src=1, chunk_bytes=4096)  # many chunks, the last one short
        out["from_1"], out["blob_1"] = got1.version, got1.to_bytes()
    out["warned"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    out["bad_src"] = raises(td.broadcast_payload, None, src=2)
    return out


def rank_generate(rank: int) -> dict:
    sampler = td.DistributedSampler(moe_sampler())
    got = sampler.generate(PROMPTS, PARAMS)
    again = sampler.generate(PROMPTS[:1], PARAMS)  # one prompt: rank 1's shard is empty
    mismatch = raises(sampler.generate, PROMPTS if rank == 0 else PROMPTS[::-1], PARAMS)
    empty = raises(sampler.generate, [], PARAMS)  # refused like Sampler.generate([]), on every rank
    one_empty = raises(sampler.generate, [] if rank == 0 else PROMPTS, PARAMS)
    after = sampler.generate(PROMPTS, PARAMS)  # the group is still usable
    # the same version, other weights (a payload digest the other rank does not hold): refused on every rank
    digest = sampler.sampler.weights_digest
    if rank == 1:
        sampler.sampler.weights_digest = "0" * 32
    other_weights = raises(sampler.generate, PROMPTS, PARAMS)
    sampler.sampler.weights_digest = digest
    return dict(got=got, again=again, mismatch=mismatch, empty=empty, one_empty=one_empty,
                after_equal=completions_equal(after, got),
                other_weights=other_weights,
                version=sampler.policy_version, max_seq_len=sampler.max_seq_len, world=sampler.world_size)


def rank_load(rank: int) -> dict:
    model, contract = converted_model(DENSE, "nvfp4-linear")  # every rank builds the same trainer model
    sampler = td.DistributedSampler(Sampler(model, eos_token_ids=[]))
    before = weights_digest(sampler)
    optimizer_step(model)
    payload = build_payload(model, contract, version=1, dense_dtype=torch.float32) if rank == 0 else None
    real_check, checks = Payload.check, []

    def counted_check(self):
        checks.append(self.version)
        return real_check(self)

    Payload.check = counted_check  # the received payload is hashed once (apply_payload), not twice
    try:
        sampler.load(payload, verify=True)
    finally:
        Payload.check = real_check
    verify_equal(sampler.sampler, model)  # every rank holds the bytes rank 0's trainer quantized
    out = dict(before=before, after=weights_digest(sampler), version=sampler.policy_version, checks=checks,
               greedy=[c.completion_ids for c in sampler.generate([[3, 4, 5], [9, 1]], GREEDY)])
    # a payload corrupted after sealing: refused by every rank, weights kept
    bad = None
    if rank == 0:
        bad = build_payload(model, contract, version=2, dense_dtype=torch.float32)
        t = bad.dense["model.norm.weight"].clone()
        t.view(torch.uint8)[5] ^= 0x10
        bad = dataclasses.replace(bad, dense={**bad.dense, "model.norm.weight": t})
    out["corrupt"] = raises(sampler.load, bad, verify=True)
    out["after_corrupt"] = (weights_digest(sampler), sampler.policy_version)
    # one rank refuses (its sampler is ahead: a stale payload for it): every rank raises
    if rank == 1:
        sampler.sampler.policy_version = 9
    good = build_payload(model, contract, version=2, dense_dtype=torch.float32) if rank == 0 else None
    out["one_refuses"] = raises(sampler.load, good)
    out["final_version"] = sampler.policy_version
    return out


def rank_grads(rank: int) -> dict:
    torch.manual_seed(0)
    module = torch.nn.ModuleDict(dict(a=torch.nn.Linear(7, 5), b=torch.nn.Linear(5, 3, bias=False),
                                      unused=torch.nn.Linear(2, 2)))
    module["b"].double()
    g = torch.Generator().manual_seed(100 + rank)  # different grads per rank
    for name, p in module.named_parameters():
        if not name.startswith("unused"):
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    before = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    td.average_gradients(module, bucket_bytes=64)  # small buckets: several all-reduces per dtype
    after = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    nones = [n for n, p in module.named_parameters() if p.grad is None]
    if rank == 1:  # one rank leaves another grad None: every rank is told
        module["a"].bias.grad = None
    mismatch = raises(td.average_gradients, module)
    return dict(before=before, after=after, nones=nones, mismatch=mismatch)


def rank_load_unsealed(rank: int) -> dict:
    """The RL loop's unsealed payload on rank 0: DistributedSampler.load seals it once for the broadcast, so
    every rank (rank 0 loading the object, the others the bytes) holds the same digest and generate's check
    that the ranks hold the same weights passes; a re-push of the same object is accepted."""
    model, contract = converted_model(DENSE, "nvfp4-linear")
    sampler = td.DistributedSampler(Sampler(model, eos_token_ids=[]))
    optimizer_step(model)
    payload = build_payload(model, contract, version=1, dense_dtype=torch.float32, seal=False) \
        if rank == 0 else None
    sampler.load(payload, verify=True)
    out = dict(digest=sampler.sampler.weights_digest, version=sampler.policy_version,
               sealed_here=payload.sealed if rank == 0 else None,
               greedy=[c.completion_ids for c in sampler.generate([[3, 4, 5], [9, 1]], GREEDY)])
    sampler.load(payload)  # the same object again (sealed now): accepted on every rank
    out["again"] = [c.completion_ids for c in sampler.generate([[3, 4, 5], [9, 1]], GREEDY)]
    return out


PROGRAMS = dict(broadcast=rank_broadcast, generate=rank_generate, load=rank_load, grads=rank_grads,
                load_unsealed=rank_load_unsealed)


def _rank_main(rank: int, world: int, init: str, out_dir: str, program: str) -> None:
    """One rank: run the program, write its result (or its traceback), then leave with os._exit.

    The ranks meet at a barrier before tearing the group down, so no rank closes its gloo connections
    while the other is still inside the last collective. os._exit skips interpreter finalization: on a
    loaded machine torch's gloo teardown there can abort a process (`terminate called without an active
    exception`, exit -6) after everything it had to do is done and written (seen once in CI, in this
    test's `load` program; pytorch/pytorch#179291 describes that teardown)."""
    out = Path(out_dir)
    code = 1
    try:
        torch.set_num_threads(1)
        torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                             timeout=timedelta(seconds=30))
        try:
            result = PROGRAMS[program](rank)
            torch.distributed.barrier()
        finally:
            torch.distributed.destroy_process_group()
        (out / f"rank{rank}.pkl").write_bytes(pickle.dumps(td.to_wire(result)))
        code = 0
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_ranks(tmp_path: Path, program: str, world: int = WORLD, timeout: float = 90.0) -> list:
    """Run PROGRAMS[program] on `world` gloo ranks; their results, by rank."""
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_rank_main, args=(r, world, init, str(tmp_path), program), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join(5)
    errors = {r: (tmp_path / f"rank{r}.err").read_text() for r in range(world)
              if (tmp_path / f"rank{r}.err").exists()}
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
    assert not hung, f"ranks {hung} did not finish within {timeout:.0f} s (a collective hung?)"
    assert [p.exitcode for p in procs] == [0] * world
    missing = [r for r in range(world) if not (tmp_path / f"rank{r}.pkl").exists()]
    assert not missing, f"ranks {missing} exited 0 without writing their results"
    return [td.from_wire(pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes())) for r in range(world)]


def completions_equal(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        for f in dataclasses.fields(Completion):
            u, v = getattr(x, f.name), getattr(y, f.name)
            if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
                if not (isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and u.dtype == v.dtype
                        and torch.equal(u, v)):
                    return False
            elif u != v:
                return False
    return True


# ----------------------------------------------------------------------------------------------
# Tests


def test_broadcast_payload_delivers_rank0_bytes(tmp_path):
    r0, r1 = run_ranks(tmp_path, "broadcast")
    assert r0["same_object"] and not r1["same_object"]
    assert r1["blob"] == r0["blob"] and r1["digest"] == r0["digest"]
    for r in (r0, r1):
        assert r["from_1"] == 5  # rank 1's payload, not rank 0's v4
        assert r["blob_1"] == r1["blob_1"] and len(r["blob_1"]) % 4096
        assert "src" in r["bad_src"] and r["bad_src"].startswith("ValueError")
    assert r0["src_none"].startswith("TypeError") and "must pass a weight_sync.Payload" in r0["src_none"]
    assert r1["src_none"].startswith("RuntimeError") and "src rank 0 had no payload" in r1["src_none"]
    assert len(r0["warned"]) == 1 and "ignored" in r0["warned"][0] and r1["warned"] == []


def test_distributed_generate_equals_local_shards(tmp_path):
    ranks = run_ranks(tmp_path, "generate")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks
    try:
        sampler = moe_sampler()
        want = LocalShards(sampler, WORLD).generate(PROMPTS, PARAMS)
        want_one = LocalShards(sampler, WORLD).generate(PROMPTS[:1], PARAMS)
    finally:
        torch.set_num_threads(threads)
    assert [c.prompt_index for c in want] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert not completions_equal(want, sampler.generate(PROMPTS, PARAMS)), "shard 1 samples with its own seed"
    assert all(c.routing is not None and c.routing.dtype == torch.int16 for c in want)
    assert ranks[0]["one_empty"].startswith("ValueError") and "non-empty list" in ranks[0]["one_empty"]
    assert ranks[1]["one_empty"].startswith("RuntimeError") and "failed on rank 0" in ranks[1]["one_empty"]
    for r in ranks:
        assert r["empty"].startswith("ValueError") and "non-empty list of prompts" in r["empty"]
        assert completions_equal(r["got"], want)  # tokens, logprobs, indices, finish_reason, routing
        assert [(c.prompt_index, c.sample_index, c.finish_reason) for c in r["got"]] == \
            [(c.prompt_index, c.sample_index, c.finish_reason) for c in want]
        assert completions_equal(r["again"], want_one)
        assert r["mismatch"].startswith("ValueError") and "different prompts" in r["mismatch"]
        assert r["other_weights"].startswith("ValueError") and "hold different weights" in r["other_weights"]
        assert "v0 000000000000" in r["other_weights"]
        assert r["after_equal"]
        assert r["version"] == 0 and r["max_seq_len"] == sampler.max_seq_len and r["world"] == WORLD


def loaded_reference():
    """A local sampler holding what the "load" programs' rank 0 pushes (v1 after one step), and its greedy
    completions of two prompts."""
    model, contract = converted_model(DENSE, "nvfp4-linear")
    reference = Sampler(model, eos_token_ids=[])
    optimizer_step(model)
    reference.load(build_payload(model, contract, version=1, dense_dtype=torch.float32), verify=True)
    return reference, [c.completion_ids for c in reference.generate([[3, 4, 5], [9, 1]], GREEDY)]


def test_distributed_load_syncs_every_rank(tmp_path):
    r0, r1 = run_ranks(tmp_path, "load")
    reference, want = loaded_reference()
    assert r0["before"] == r1["before"] != r0["after"]
    assert r0["after"] == r1["after"] == weights_digest(reference)
    assert r0["version"] == r1["version"] == 1
    assert r0["checks"] == r1["checks"] == [1]  # every rank hashes the payload once
    assert r0["greedy"] == r1["greedy"] == want
    for r in (r0, r1):
        assert r["corrupt"].startswith("ValueError") and "does not match its checksum" in r["corrupt"]
        assert r["after_corrupt"] == (r0["after"], 1)
    assert r0["one_refuses"].startswith("RuntimeError") and "failed on rank(s) [1]" in r0["one_refuses"]
    assert r1["one_refuses"].startswith("ValueError") and "older than" in r1["one_refuses"]
    assert r0["final_version"] == 2 and r1["final_version"] == 9


def test_distributed_load_of_an_unsealed_payload(tmp_path):
    r0, r1 = run_ranks(tmp_path, "load_unsealed")
    reference, want = loaded_reference()
    assert r0["sealed_here"] is True and r0["version"] == r1["version"] == 1
    assert r0["digest"] == r1["digest"] == reference.weights_digest  # the content digest, on every rank
    assert r0["greedy"] == r1["greedy"] == r0["again"] == r1["again"] == want


def test_average_gradients_is_the_mean_bit_for_bit(tmp_path):
    r0, r1 = run_ranks(tmp_path, "grads")
    assert set(r0["after"]) == {"a.weight", "a.bias", "b.weight"}
    assert r0["nones"] == r1["nones"] == ["unused.weight", "unused.bias"]
    for name, g in r0["after"].items():
        a, b = r0["before"][name], r1["before"][name]
        assert not torch.equal(a, b)
        assert g.dtype == a.dtype and torch.equal(g, (a + b) / 2)
        assert torch.equal(g.view(-1).view(torch.uint8), r1["after"][name].view(-1).view(torch.uint8))
    for r in (r0, r1):
        assert r["mismatch"].startswith("RuntimeError") and "which grads are None" in r["mismatch"]


# ----------------------------------------------------------------------------------------------
# In-process


def test_clear_error_without_a_process_group():
    assert not torch.distributed.is_initialized()
    calls = [lambda: td.broadcast_payload(None), lambda: td.all_gather_completions([]),
             lambda: td.DistributedSampler(object()), lambda: td.average_gradients(torch.nn.Linear(2, 2))]
    for call in calls:
        with pytest.raises(RuntimeError, match="not initialized.*init_process_group.*torchrun"):
            call()


def test_received_bytes_are_checked():
    model, contract = converted_model(DENSE, "nvfp4-linear")
    payload = build_payload(model, contract, version=2)
    blob = payload.to_bytes()
    assert td.payload_from_bytes(blob).digest == payload.digest
    tampered = bytearray(blob)
    tampered[-100] ^= 0x01  # inside the tensor data
    with pytest.raises(ValueError, match="does not match its checksum"):
        td.payload_from_bytes(bytes(tampered))
    with pytest.raises(ValueError, match="not a readable fp4rl payload"):
        td.payload_from_bytes(blob[:1000])


def test_completions_with_tensors_survive_the_wire():
    guidance = {"layer.1": {"bits": torch.arange(6, dtype=torch.uint8).reshape(3, 2),
                            "block_scale": torch.tensor([0.5, 1.0, 448.0]).to(torch.float8_e4m3fn),
                            "amax": torch.tensor([1.5, 2.0, 3.0])}}
    routing = torch.arange(24, dtype=torch.int16).reshape(2, 3, 4)[:, 1:]  # a view of a larger storage
    c = Completion(prompt_index=0, sample_index=1, prompt_ids=[1, 2], completion_ids=[3, 4],
                   logprobs=[-0.5, -1.0], text="", finish_reason="length", policy_version=3, routing=routing,
                   guidance=guidance)  # float8 block scales: plain pickle of them fails in torch 2.13
    (wire,) = td.to_wire([c])
    assert len(wire.routing.data) == 2 * routing.numel()  # the sampler's int16 routing travels as 2 B an id
    (back,) = td.from_wire(pickle.loads(pickle.dumps([wire])))
    assert back.routing.dtype == torch.int16
    assert completions_equal([dataclasses.replace(back, guidance=None)],
                             [dataclasses.replace(c, guidance=None)])
    for k, t in guidance["layer.1"].items():
        u = back.guidance["layer.1"][k]
        assert u.dtype == t.dtype and u.shape == t.shape
        assert torch.equal(u.view(torch.uint8), t.view(torch.uint8))
    assert c.routing is routing  # the original is not modified

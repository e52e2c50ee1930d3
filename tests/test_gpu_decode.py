"""The sampler's kernel path (fp4rl/gpu_decode.py) against its plain-torch path: packed W4A16/W4A4
linears on the Triton GEMMs, grouped experts, static KV cache with in-place prefill copies and
compaction, decode attention over NVFP4/FP8 caches with left padding, weight sync, the dense copy; CUDA
graphs on a GPU. The fused decode step: test_gpu_decode_fused.py. On a machine without CUDA the kernels run
in Triton's interpreter (conftest.py)."""

import pytest
import torch
from gpu_decode_cases import (  # (before fp4rl: it sets TRITON_INTERPRET without CUDA)
    DENSE,
    DEV,
    MOE,
    PROMPTS,
    WIDE,
    WIDE_MOE,
    V,
    _pair,
    teacher_forced_logits,
    tiny,
)

from fp4rl import decode_kv, gpu_decode, gpu_linear  # noqa: E402
from fp4rl.kernels import attention, gemm, gemv_cuda  # noqa: E402
from fp4rl.kvcache import NVFP4KVCache  # noqa: E402
from fp4rl.model import ModelConfig  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402
from fp4rl.precision import PrecisionContract  # noqa: E402
from fp4rl.sampler import Sampler, SamplingParams  # noqa: E402


@pytest.fixture(autouse=True)
def _first_gemm_candidate(monkeypatch):
    """No GEMM tuning on a GPU: it compiles ~20 configurations per shape (the CPU never tunes)."""
    monkeypatch.setattr(gpu_linear, "TUNE", False)



@pytest.mark.parametrize("config,contract,kv", [
    (DENSE, "nvfp4-w4a16", "bf16"),
    (DENSE, "bf16", "nvfp4"),
    (MOE, "nvfp4-w4a16", "bf16"),
    (MOE, "bf16", "fp8"),
])
def test_kernel_decode_steps_compute_the_torch_decode_steps(config, contract, kv):
    """Same tokens in, same logits out (to bfloat16 rounding), over left-padded prompts.

    Only one quantizer sits between the two paths here. Ahead of an NVFP4 KV cache or a W4A4
    activation quantizer, the GEMMs' bfloat16-level differences flip FP4 codes (and 4-vs-6
    choices), and on this random model the logits then differ by 10-30% already in the prefill,
    which does not use the decode engine (measured): the quantizer's sensitivity, not the kernels'.
    W4A4 is checked module by module below."""
    fast, plain = _pair(config, contract, kv)
    forced = torch.randint(0, V, (len(PROMPTS), 4), generator=torch.Generator().manual_seed(1))
    a, b = teacher_forced_logits(fast, forced), teacher_forced_logits(plain, forced)
    err = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()  # worst (row, step)
    assert err < 3e-2, err
    kinds = {type(m).__name__ for m in fast.model.modules()}
    if contract != "bf16":
        assert "KernelPackedLinear" in kinds
    if config is MOE:
        assert all(layer.mlp.plan is not None for layer in fast.model.model.layers)


@pytest.mark.gpu
@pytest.mark.parametrize("contract,tol", [("nvfp4-w4a16", 1e-2), ("nvfp4-experts", 8e-2)])
def test_gpu_grouped_mma16_experts_compute_the_packed_experts(contract, tol):
    """Routed experts on the grouped mma16 kernel (WIDE_MOE: every expert GEMM fits it) against the plain
    packed modules on the same input, at decode batch sizes (1-32 tokens); the same experts chosen.
    (Teacher-forced logits of a whole random model are not the check: a one-ulp router difference can
    pick another expert.) W4A4's bound: down_proj's Q(x) sees bfloat16-level gate/up differences."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    fast, plain = _pair(WIDE_MOE, contract, "bf16")
    a, b = fast.model.model.layers[0].mlp, plain.model.model.layers[0].mlp
    for rows in (1, 3, 8, 16, 32):
        x = torch.randn(rows, 1, 128, generator=torch.Generator().manual_seed(rows)).bfloat16().to(DEV)
        with torch.inference_mode():
            ya, ea = a(x)
            yb, eb = b(x)
        assert torch.equal(ea, eb)
        err = ((ya.float() - yb.float()).norm() / yb.float().norm()).item()
        assert err < tol, (rows, err)
    assert a.plan.copy_bytes > 0  # the stacked mma16 copies were built and used


@pytest.mark.parametrize("config", [DENSE, MOE])
def test_w4a4_kernel_modules_compute_the_packed_modules(config):
    """W4A4 on the kernels (one Q(x) per fused group / per expert row, exact-operand product) vs the
    plain packed modules (DQ(Q(x)) @ DQ(W).T in bfloat16), module by module on the same input."""
    fast, plain = _pair(config, "nvfp4-linear", "bf16")
    x = torch.randn(6, 1, 64, generator=torch.Generator().manual_seed(2)).bfloat16().to(DEV)
    a, b = fast.model.model.layers[0], plain.model.model.layers[0]

    def rel(u, w):
        return ((u.float() - w.float()).norm() / w.float().norm()).item()

    with torch.inference_mode():
        for name in ("q_proj", "k_proj", "v_proj"):  # one fused group: the same x object each time
            assert rel(getattr(a.self_attn, name)(x), getattr(b.self_attn, name)(x)) < 1e-2, name
        h = torch.randn(6, 1, 128, generator=torch.Generator().manual_seed(3)).bfloat16().to(DEV)
        assert rel(a.self_attn.o_proj(h), b.self_attn.o_proj(h)) < 1e-2
        if config is MOE:
            ya, ea = a.mlp(x)
            yb, eb = b.mlp(x)
            assert torch.equal(ea, eb)  # the BF16 router picks the same experts
        else:
            ya, yb = a.mlp(x), b.mlp(x)
        assert rel(ya, yb) < 8e-2  # down_proj's Q(x) sees bfloat16-level gate/up differences (H200: 0.056)


def test_generate_compaction_static_cache_reuse_and_weight_sync():
    """Rows that finish leave the batch (in-place compaction) without changing the other rows, the
    static cache is reused by the next call, and a weight sync reaches the kernels' stacked
    weights and per-row global scales (same output as a sampler built from the new weights)."""
    from fp4rl.weight_sync import build_payload

    model = tiny(MOE, "nvfp4-linear")
    params = SamplingParams(n=2, greedy=True, max_new_tokens=4)
    kw = dict(kv_cache="nvfp4", device=DEV, dtype=torch.bfloat16, kernels=True)
    probe = Sampler(model, eos_token_ids=[], **kw).generate(PROMPTS, params)
    eos = probe[0].completion_ids[1]  # row 0 ends at its second token; others may end too
    fast = Sampler(model, eos_token_ids=[eos], **kw)
    expected = [c.completion_ids[:c.completion_ids.index(eos) + 1] if eos in c.completion_ids
                else c.completion_ids for c in probe]
    first = fast.generate(PROMPTS, params)
    static = fast.engine.static
    again = fast.generate(PROMPTS, params)
    assert fast.engine.static is static
    for c, e, d in zip(first, expected, again):  # the kernels are batch-invariant on the CPU
        assert c.completion_ids == e and d.completion_ids == e and c.logprobs == d.logprobs
        assert c.finish_reason == ("eos" if e[-1] == eos else "length")
    with torch.no_grad():  # new trainer weights, synced into the sampler
        for p in model.parameters():
            p.mul_(1.25)
    fast.load(build_payload(model, PrecisionContract("nvfp4-linear", bf16_last_fraction=0.0), 1))
    synced = fast.generate(PROMPTS, params)
    fresh = Sampler(model, eos_token_ids=[eos], **kw).generate(PROMPTS, params)
    assert [c.completion_ids for c in synced] == [c.completion_ids for c in fresh]
    assert [c.logprobs for c in synced] == [c.logprobs for c in fresh]
    assert [c.completion_ids for c in synced] != [c.completion_ids for c in first]


def _dense_owners(s):
    """(owner, its DQ(W) in bfloat16 as the reference makes it) for every packed dense linear and fused group
    of the sampler's kernel model (not the routed experts')."""
    groups = [g for g in s.model.fused_groups if isinstance(g, gpu_linear.KernelFusedGroup)]
    lins = [m for m in s.model.modules() if isinstance(m, gpu_linear.KernelPackedLinear) and m.dense_rows]
    return ([(g, torch.cat([m.dequantized_weight(torch.bfloat16) for m in g.members])) for g in groups]
            + [(m, m.dequantized_weight(torch.bfloat16)) for m in lins])


@pytest.mark.parametrize("config,contract", [(DENSE, "nvfp4-w4a16"), (MOE, "nvfp4-linear")])
def test_dense_copy_serves_the_calls_of_dense_rows(config, contract, monkeypatch):
    """Sampler(dense_rows=R): calls of R rows or more (here the prefill's 21) run cuBLAS on each packed dense
    linear's and fused group's DQ(W) copy (the reference dequantize bit for bit: the product is the
    reference's, W4A4 on DQ(Q(x))); calls of fewer rows (the decode steps' 4-row bucket) the 4-bit kernels;
    routed experts never take one. A weight sync rewrites the copies in their storage; memory() counts
    them."""
    from fp4rl.weight_sync import build_payload

    model = tiny(config, contract)
    kw = dict(kv_cache="bf16", device=DEV, dtype=torch.bfloat16, eos_token_ids=[])
    s = Sampler(model, kernels=True, dense_rows=5, **kw)
    calls, real = [], gpu_linear.packed_gemm

    def spy(x2, weight, mode, input_kwargs, offsets=None, xq=None, **k):
        rows = x2.shape[0] if x2 is not None else xq[0].shape[0]
        calls.append((rows, hasattr(weight, "dense"), offsets is not None))
        return real(x2, weight, mode, input_kwargs, offsets, xq=xq, **k)

    monkeypatch.setattr(gpu_linear, "packed_gemm", spy)
    forced = torch.randint(0, V, (len(PROMPTS), 3), generator=torch.Generator().manual_seed(2))
    a = teacher_forced_logits(s, forced)
    if contract == "nvfp4-w4a16":  # (W4A4: bfloat16-level differences flip activation codes, see above)
        b = teacher_forced_logits(Sampler(model, kernels=False, fuse=True, **kw), forced)
        # this random model's peaked logits magnify bfloat16-level differences (measured spreads between paths
        # that are all right: the CPU sampler with and without its AMX GEMMs 1.9%, the kernel engine without
        # dense copies 2.7%, with them 3.6%): the copies' own exactness is checked module by module below
        err = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()
        assert err < 5e-2, err
    dense = [c for c in calls if not c[2]]
    assert {c[0] for c in dense} == {4, 3 * max(len(p) for p in PROMPTS)}  # decode bucket, prefill
    assert {c[1] for c in dense if c[0] >= 5} == {True} and {c[1] for c in dense if c[0] < 5} == {False}
    assert (config is MOE) == any(c[2] for c in calls) and not any(c[1] for c in calls if c[2])
    owners = _dense_owners(s)
    layers = config["num_hidden_layers"]
    assert len(owners) == 2 * layers + (0 if config is MOE else 2 * layers)  # qkv, o (+ gate/up, down)
    x = torch.randn(6, config["hidden_size"], generator=torch.Generator().manual_seed(3)).to(DEV).bfloat16()
    for owner, dq in owners:
        assert torch.equal(owner._dense.copy, dq), owner
        if dq.shape[1] != x.shape[1]:
            continue
        xin = x
        if contract == "nvfp4-linear":  # W4A4: DQ(Q(x)) with the contract's activation quantizer
            ik = (owner.members[0] if isinstance(owner, gpu_linear.KernelFusedGroup) else owner).input_kwargs
            xq = gemm.quantize_activations(x, scale_rule=ik["scale_rule"], err=ik["err"])
            xin = gemm.dequantize(*xq, torch.bfloat16)
        assert torch.equal(owner.run(x), torch.matmul(xin, dq.t())), owner  # (no biases here)
    assert s.memory()["dense_copy_bytes"] == sum(dq.nbytes for _, dq in owners)
    keys = [owner._dense.key for owner, _ in owners]
    teacher_forced_logits(s, forced)  # unchanged weights: no rebuild (a fused group rewrites g_rows anyway)
    assert all(owner._dense.key is key for (owner, _), key in zip(owners, keys))
    if config is DENSE:  # a member's global scale written in place (no load, no invalidate): followed
        group = owners[0][0]
        with torch.no_grad():
            group.members[1].weight_global_scale.mul_(2)
        teacher_forced_logits(s, forced)
        assert torch.equal(group._dense.copy, _dense_owners(s)[0][1]) and group._dense.key is not keys[0]
    ptrs = [owner._dense.copy.data_ptr() for owner, _ in owners]
    with torch.no_grad():  # new trainer weights, synced into the sampler
        for p in model.parameters():
            p.mul_(1.25)
    s.load(build_payload(model, PrecisionContract(contract, bf16_last_fraction=0.0), 1))
    teacher_forced_logits(s, forced)
    for (owner, dq), ptr in zip(_dense_owners(s), ptrs):
        assert owner._dense.copy.data_ptr() == ptr and torch.equal(owner._dense.copy, dq), owner
    assert not torch.equal(owners[0][1], _dense_owners(s)[0][1])  # the weights did change


def test_dense_copy_refused_where_it_cannot_run():
    model = tiny(DENSE, "nvfp4-w4a16")
    kw = dict(device=DEV, dtype=torch.bfloat16, eos_token_ids=[])
    with pytest.raises(ValueError, match=r"dense_rows=4 is for the CUDA kernel engine.*pass dense_rows=0"):
        Sampler(model, kernels=False, dense_rows=4, **kw)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=r"dense_rows=.*an integer >= 0"):
            Sampler(model, kernels=True, dense_rows=bad, **kw)
    lin = next(m for m in Sampler(model, kernels=True, **kw).model.modules()
               if isinstance(m, gpu_linear.KernelPackedLinear))
    w = lin.quantized_weight()
    x = torch.randn(2, lin.in_features, device=DEV).bfloat16()
    bad = gpu_linear._with_dense(w, lin.dequantized_weight(torch.bfloat16).t().contiguous())
    with pytest.raises(ValueError, match=r"weight.dense must be the weight's DQ\(W\), bfloat16 \[\d+, \d+\]"):
        gemm.gemm(x, bad)
    # a copy that does not fit: an OutOfMemoryError that names the knob and the fix; the owner is left as it
    # was (no copy), and a later call with the memory back builds it
    real_empty, n, k = torch.empty, lin.out_features, lin.in_features

    def empty(*size, **kw):
        if tuple(size) == (n, k) and kw.get("dtype") == torch.bfloat16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 MiB")
        return real_empty(*size, **kw)

    copy = gpu_linear._DenseCopy(5)
    parts = (lin.weight_data, lin.weight_block_scale, lin.weight_global_scale)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", empty)
        want = (rf"Sampler\(dense_rows=5\) \(config sampler.dense_rows\): the bfloat16 copy of a "
                rf"{n}x{k} NVFP4 weight .*Set sampler.dense_rows = 0")
        with pytest.raises(torch.OutOfMemoryError, match=want):
            copy.get(*parts)
    assert copy.copy is None and copy.key is None
    assert torch.equal(copy.get(*parts), lin.dequantized_weight(torch.bfloat16))


def test_decode_attention_skips_left_padding():
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, t, d = 3, 4, 2, 40, 32
    q = torch.randn(b, hq, d, generator=g).bfloat16().to(DEV)
    k = torch.randn(b, hkv, t, d, generator=g).to(DEV)
    v = torch.randn(b, hkv, t, d, generator=g).to(DEV)
    starts = torch.tensor([0, 7, 33], dtype=torch.int32, device=DEV)
    lengths = torch.tensor([40, 30, 35], dtype=torch.int32, device=DEV)
    kd, ks, kg = attention.quantize_kv_nvfp4(k)
    vd, vs, vg = attention.quantize_kv_nvfp4(v)
    out = attention.decode_attention(q, lengths, kd, vd, kg, vg, k_scale=ks, v_scale=vs, starts=starts)
    kq = reference.dequantize(reference.quantize(k, scale_scope="row")).double()
    vq = reference.dequantize(reference.quantize(v, scale_scope="row")).double()
    for i in range(b):
        s, e = int(starts[i]), int(lengths[i])
        kk = kq[i, :, s:e].repeat_interleave(hq // hkv, 0)
        vv = vq[i, :, s:e].repeat_interleave(hq // hkv, 0)
        ref = (torch.einsum("hd,htd->ht", q[i].double(), kk) / d ** 0.5).softmax(-1)
        ref = torch.einsum("ht,htd->hd", ref, vv)
        assert ((out[i].double() - ref).norm() / ref.norm()).item() < 1e-2


def test_decode_kv_write_is_the_cache_quantizer_byte_for_byte():
    config = ModelConfig(**DENSE)
    a = NVFP4KVCache(config, 2, 8, dtype=torch.bfloat16, device=DEV)
    b = NVFP4KVCache(config, 2, 8, dtype=torch.bfloat16, device=DEV)
    g = torch.Generator().manual_seed(3)
    k = (torch.randn(2, 2, 1, 32, generator=g) * 3).bfloat16().to(DEV)
    v = torch.randn(2, 2, 1, 32, generator=g).bfloat16().to(DEV)
    slot = torch.tensor([5], device=DEV)
    a.length = 5
    a.update(0, k, v, slot)  # the CPU path: fp4rl.nvfp4.quantize, 4/6 MSE, one scale per (row, head, slot)
    decode_kv.store_kv(b, 0, k, v, slot, 2)
    for name in a.buffer_names:
        assert torch.equal(getattr(a, name)[0].view(torch.uint8), getattr(b, name)[0].view(torch.uint8)), name


def test_engine_rope_rows_are_the_models_tables():
    """A step gathers RoPE's rows from the engine's table: the bits model.rope_tables gives at those
    positions, for every slot of the cache, the table grown with the cache."""
    engine = Sampler(tiny(DENSE, "bf16"), device=DEV, kernels=True, dtype=torch.bfloat16).engine
    m = engine.model.model
    for total in (40, 100):  # a cache of 64 slots, then one of 128
        engine.new_cache("bf16", 3, 3, total)
        p = engine.static.max_len
        assert engine.rope.shape == (p, 2, DENSE["head_dim"]) and engine.rope.dtype == torch.bfloat16
        pos = torch.tensor([0, 37, p - 1], device=DEV)
        engine.positions[:3].copy_(pos)
        cos, sin = engine._rope_rows(3)
        want_cos, want_sin = m.rope_tables(pos, torch.bfloat16)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        assert not torch.equal(cos, sin)


def test_kernels_need_bfloat16():
    with pytest.raises(ValueError, match="bfloat16"):
        Sampler(tiny(DENSE, "nvfp4-w4a16").float(), device=DEV, kernels=True)


@pytest.mark.gpu
@pytest.mark.parametrize("config,contract,kv", [(DENSE, "nvfp4-linear", "nvfp4"),
                                                (MOE, "nvfp4-experts", "fp8"), (MOE, "bf16", "bf16"),
                                                (DENSE, "nvfp4-w4a16", "bf16"), (WIDE, "nvfp4-w4a16", "bf16"),
                                                (WIDE, "nvfp4-linear", "bf16"),
                                                (WIDE_MOE, "nvfp4-experts", "bf16")])
def test_gpu_cuda_graphs_replay_the_eager_step(config, contract, kv):
    model = tiny(config, contract)
    params = SamplingParams(n=3, greedy=True, max_new_tokens=8)  # 9 rows: bucket 16, then smaller
    probe = Sampler(model, kv_cache=kv, device=DEV, eos_token_ids=[])
    eos = probe.generate(PROMPTS, params)[0].completion_ids[2]  # row 0 (at least) ends at step 3
    graphs = Sampler(model, kv_cache=kv, device=DEV, eos_token_ids=[eos])
    eager = Sampler(model, kv_cache=kv, device=DEV, eos_token_ids=[eos], cuda_graphs=False)
    a, b = graphs.generate(PROMPTS, params), eager.generate(PROMPTS, params)
    assert graphs.engine.graph_error is None and graphs.engine.counts["replays"] > 0
    assert len(graphs.engine.graphs) >= 2 and eager.engine.counts["replays"] == 0
    for x, y in zip(a, b):
        assert x.completion_ids == y.completion_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-3
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=7)
    assert [c.completion_ids for c in graphs.generate(PROMPTS, sampled)] == \
        [c.completion_ids for c in eager.generate(PROMPTS, sampled)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [DENSE, WIDE])
def test_gpu_decode_copy_follows_the_weights(config):
    """The decode kernels read a copy of the packed bytes (DENSE: gemv32 for the Gluon GEMV; WIDE: the CUDA
    mma16 kernel's where it runs): it must follow in-place writes."""
    s = Sampler(tiny(config, "nvfp4-w4a16"), device=DEV)
    lins = [m for m in s.model.modules() if isinstance(m, gpu_decode.KernelPackedLinear)]
    x = torch.randn(2, lins[0].in_features, device=DEV).bfloat16()
    for lin in lins:
        if lin.in_features != x.shape[1]:
            continue
        for step in range(2):
            ref = x.double() @ reference.dequantize(lin.quantized_weight()).double().T
            y = lin.linear(x) if lin.group is None else lin.group(lin, x)
            assert ((y.double() - ref).norm() / ref.norm()).item() < 4e-3, (lin, step)
            owner = lin if lin.group is None else lin.group
            copy = owner._gemv32
            assert copy is not None and copy.key is not None  # the copy was used (mma16 or gemv32)
            lin.weight_data.copy_(lin.weight_data.flip(0))  # a weight sync writes in place


def test_engine_records_the_routing_the_eager_sampler_records():
    """Completion.routing from the decode engine (experts stacked inside the step; a batch of 6 rows in the
    bucket of 8; rows leaving at EOS; a dense layer between two MoE layers) equals the eager sampler's at
    every position of the completions both produce."""
    config = dict(MOE, num_hidden_layers=3, mlp_only_layers=(1,))
    fast, slow = _pair(config, "nvfp4-experts", "bf16")
    params = SamplingParams(n=2, greedy=True, max_new_tokens=5)
    probe = slow.generate(PROMPTS, params)
    eos = probe[0].completion_ids[2]  # some rows end early: compaction
    fast.eos_token_ids = slow.eos_token_ids = {eos}
    a, b = fast.generate(PROMPTS, params), slow.generate(PROMPTS, params)
    compared = same = 0
    for x, y in zip(a, b):
        assert x.routing.shape == (2, len(x.prompt_ids) + len(x.completion_ids) - 1, 2)
        n = 0  # the common prefix of the two completions: the routing of those positions must agree
        while n < min(len(x.completion_ids), len(y.completion_ids)) \
                and x.completion_ids[n] == y.completion_ids[n]:
            n += 1
        upto = len(x.prompt_ids) + max(0, n - 1)
        xr, yr = x.routing[:, :upto].sort(-1).values, y.routing[:, :upto].sort(-1).values
        compared += xr.numel()
        same += int((xr == yr).sum())
    assert compared > 0 and same >= 0.97 * compared, (same, compared)  # near-ties may flip an expert

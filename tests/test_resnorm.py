"""The residual add + RMSNorm split over the two GEMMs around it (fp4rl.kernels.resnorm; gemv_mma16.cu RN_OUT
/ RN_IN, gemv_cuda.launch(rn_out=, rn_in=); the fused decode step's RESNORM).

On CPU: the torch arithmetic against fused.add_rmsnorm and against scalar emulations of the kernels' sum
orders; which configurations have the builds; the launcher's refusals; the fused step's plumbing with the
sites' torch stand-ins (gpu_linear.RN_EMULATE). The builds compile: tests/test_cuda_sources.py. On the GPU
(-m gpu): the producer's x', xt and tile sums bit for bit against resnorm.produce of the plain launch; the
consumer against the plain launch times rstd (bit for bit where rstd is a power of two), GU_SILU too, under a
CUDA graph; decoding with RESNORM on and off."""

import gpu_decode_cases
import numpy as np
import pytest
import torch
from gpu_decode_cases import (  # (first: TRITON_INTERPRET)
    DENSE,
    DEV,
    PROMPTS,
    WIDE,
    V,
    teacher_forced_logits,
    tiny,
)

from fp4rl import gpu_decode, gpu_linear  # noqa: E402
from fp4rl.kernels import fused, gemv_cuda, resnorm  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402
from fp4rl.sampler import Sampler, SamplingParams  # noqa: E402

# every linear of this model takes the in-CTA split at one row (q/k/v 1024x512, o 512x512, gate | up
# 2048x512, down 512x1024): the RN builds' configurations
RN_MODEL = dict(DENSE, hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                head_dim=128)


def _bf16(shape, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def test_reference_is_add_rmsnorm_up_to_the_norms_rounding():
    """x' is fused.add_rmsnorm's bit for bit; rstd within 2 fp32 ulps of the float64 one; xt * rstd (the
    norm's output as the consumer's GEMM sees it) within the three bf16 roundings between it and y."""
    x, h = _bf16((5, 1024), 1), _bf16((5, 1024), 2, 0.5)
    w = (1 + 0.1 * torch.randn(1024, generator=torch.Generator().manual_seed(3))).bfloat16()
    xp, xt, rstd = resnorm.reference(x, h, w, 1e-6)
    xo, y, _ = fused.add_rmsnorm(x, h, w, 1e-6)
    assert torch.equal(xp, xo)
    exact = 1 / torch.sqrt((xp.double() ** 2).mean(1) + 1e-6)
    assert ((rstd.double() - exact).abs() / exact).max() < 2.5e-7
    seen = xt.float() * rstd[:, None]
    assert ((seen - y.float()).abs() <= y.float().abs() * 3 * 2 ** -8).all()  # y's two roundings, xt's one
    assert not torch.equal(seen.bfloat16(), y)  # (not its bits: the double rounding differs somewhere)


def _emulated_tile(q):
    """The producer's tree on one tile's 16 fp32 squares, lane by lane as the warp runs it."""
    f = np.float32
    lanes = [f(q[c]) for c in range(16)]
    lanes = [f(lanes[c] + lanes[c ^ 8]) for c in range(16)]
    for o in (1, 2, 4):
        lanes = [f(lanes[c] + lanes[c ^ o]) for c in range(16)]
    return lanes[0]


def _emulated_row(ss):
    """The consumer's order on one row's tile sums: lane l adds l + 32 i ascending, then the xor butterfly."""
    f = np.float32
    acc = [f(0)] * 32
    for c, v in enumerate(ss):
        acc[c % 32] = f(acc[c % 32] + f(v))
    for o in (16, 8, 4, 2, 1):
        acc = [f(acc[la] + acc[la ^ o]) for la in range(32)]
    return acc[0]


def test_sum_orders_are_the_kernels():
    """tile_sums and row_sums against scalar float32 emulations of the warps' shuffles (values spread over
    many binades: a different association shows)."""
    g = torch.Generator().manual_seed(4)
    xp = (torch.randn(3, 160, generator=g) * torch.exp2(torch.randint(-12, 12, (3, 160), generator=g)))
    xp = xp.bfloat16()
    ss = resnorm.tile_sums(xp)
    sq = (xp.float() ** 2).numpy()
    want = np.array([[_emulated_tile(sq[m, 16 * j:16 * j + 16]) for j in range(10)] for m in range(3)])
    assert ss.shape == (3, 10) and np.array_equal(ss.numpy(), want.astype(np.float32))
    big = torch.rand(2, 320, generator=g) * torch.exp2(torch.randint(-20, 20, (2, 320), generator=g).float())
    got = resnorm.row_sums(big)
    want = np.array([_emulated_row(big[m].numpy()) for m in range(2)], np.float32)
    assert np.array_equal(got.numpy(), want)
    assert not torch.equal(got, big.sum(1))  # (torch's own order differs: the test can tell orders apart)
    with pytest.raises(ValueError, match="multiple of 16"):
        resnorm.tile_sums(xp[:, :40])


@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 12288), (6144, 4096), (24576, 4096), (5120, 5120),
                                 (34816, 5120), (5120, 17408), (2560, 9728), (6144, 2560), (19456, 2560)])
def test_the_qwen3_one_row_gemms_have_the_builds(n, k):
    """Qwen3-8B / 14B's four dense GEMMs and 4B's down_proj at one row are in-CTA split configurations the RN
    builds take (producers and consumers); 4B's gate | up (the plain build) a consumer only."""
    assert gemv_cuda.rn_ok(gemv_cuda.choose(n, k, 1, 132), n, out=n != 19456)


def test_rn_ok_refuses_what_the_builds_do_not_cover():
    plain = dict(NT=1, MG=1, SPLIT=1, DEPTH=2)
    assert gemv_cuda.rn_ok(dict(plain, KW=4), 1024)
    assert not gemv_cuda.rn_ok(plain, 1024)  # no in-CTA split: no producer build
    assert gemv_cuda.rn_ok(plain, 1024, out=False) and gemv_cuda.rn_ok(dict(plain, MG=2), 1024, out=False)
    assert not gemv_cuda.rn_ok(dict(plain, MG=2, XSTREAM=1), 1024, out=False)  # x streamed
    assert not gemv_cuda.rn_ok(dict(plain, SPLIT=4), 1024)  # the cluster
    assert not gemv_cuda.rn_ok(dict(plain, WGMMA=1, XSTREAM=1, SWZ=1, WARPS=4), 1024)
    assert not gemv_cuda.rn_ok(dict(plain, KW=4), 1024 + 16)  # N not a multiple of the CTA's 32 rows
    for key in ("PRENORM", "SILU", "GROUPED"):
        assert not gemv_cuda.rn_ok(dict(plain, KW=2, **{key: 1}), 1024), key
    # the producer's thread t finishes column t % NB only: NB (here 192 rows) must divide its 256 threads
    assert not gemv_cuda.rn_ok(dict(plain, KW=2, NT=3), 768) and gemv_cuda.rn_ok(dict(plain, KW=2, NT=3), 768,
                                                                                  out=False)


def test_launch_refuses_bad_rn_operands():
    """Each refusal is a ValueError naming the operand and what to pass, before anything touches a device."""
    w = reference.quantize(torch.randn(512, 512) * 0.05)
    wc = gemv_cuda.relayout(w.data, w.block_scale)
    cfg = dict(NT=1, MG=1, SPLIT=1, DEPTH=2, KW=2)
    x, y = torch.zeros(2, 512, dtype=torch.bfloat16), torch.empty(2, 512, dtype=torch.bfloat16)
    res, xo, nw = torch.zeros(2, 512, dtype=torch.bfloat16), torch.empty(2, 512, dtype=torch.bfloat16), \
        torch.ones(512, dtype=torch.bfloat16)
    ss = torch.empty(2, 32)
    g = w.global_scale
    with pytest.raises(ValueError, match="no RN build"):
        gemv_cuda.launch(x, wc, g, y, cfg=dict(cfg, KW=1), rn_out=(res, xo, nw, ss))
    with pytest.raises(ValueError, match="no RN build"):
        gemv_cuda.launch(x, wc, g, torch.empty(2, 256, dtype=torch.bfloat16), cfg=cfg, silu_out=True,
                         rn_out=(res, xo, nw, ss))
    with pytest.raises(ValueError, match="W4A4"):
        gemv_cuda.launch(x, wc, g, y, cfg=cfg, x_scale=torch.ones(2), rn_in=(ss, 1e-6))
    with pytest.raises(ValueError, match="the norm weight must be a contiguous"):
        gemv_cuda.launch(x, wc, g, y, cfg=cfg, rn_out=(res, xo, nw[:256], ss))
    with pytest.raises(ValueError, match=r"ss \(the tile sums\) must be a contiguous torch.float32 \[2, 32"):
        gemv_cuda.launch(x, wc, g, y, cfg=cfg, rn_out=(res, xo, nw, ss.double()))
    with pytest.raises(ValueError, match="must not overlap"):
        gemv_cuda.launch(x, wc, g, y, cfg=cfg, rn_out=(res, res, nw, ss))
    in_y = y.view(torch.float32).view(-1)[:64].view(2, 32)  # (ss over y's bytes)
    with pytest.raises(ValueError, match="must not overlap"):
        gemv_cuda.launch(x, wc, g, y, cfg=cfg, rn_out=(res, xo, nw, in_y))
    with pytest.raises(ValueError, match="the residual must be bfloat16"):
        gemv_cuda.launch(x, wc, g, y, cfg=cfg, rn_out=(res.float(), xo, nw, ss))
    with pytest.raises(ValueError, match=r"rn_in: ss .* must be a contiguous torch.float32 \[2, 32\]"):
        gemv_cuda.launch(x, wc, g, y, cfg=cfg, rn_in=(ss[:, :16], 1e-6))


def _failing_kernels(monkeypatch, exc):
    """The sites' RN plan as if the kernel took every call (while RN_STATE is ok), its launch raising exc."""
    from types import SimpleNamespace

    monkeypatch.setitem(gpu_linear.RN_STATE, "ok", True)
    monkeypatch.setattr(gpu_linear, "_rn_plan", lambda owner, data, scale, rows, device, out: (
        SimpleNamespace(n=data.shape[0], k=2 * data.shape[1]), dict(NT=1, MG=1, SPLIT=1, DEPTH=2, KW=2))
        if gpu_linear.RN_STATE["ok"] else None)

    def launch(*a, **kw):
        raise exc

    monkeypatch.setattr(gemv_cuda, "launch", launch)


def test_a_failing_kernel_falls_back(monkeypatch):
    """A RuntimeError from the RN launch (NVRTC or the driver) turns the split off with a warning: rn_out_run
    returns None (the caller runs unsplit) and rn_in_run gives resnorm.consume of the plain GEMM (the producer
    already ran); a ValueError (operands the launch does not take) falls back for that call only."""
    monkeypatch.setattr(gpu_linear, "TUNE", False)
    s = Sampler(tiny(WIDE, "nvfp4-w4a16"), kv_cache="bf16", device=DEV, dtype=torch.bfloat16,
                eos_token_ids=[], kernels=True)
    layer = s.engine.model.model.layers[0]
    o, gu = layer.self_attn.o_proj, layer.mlp.gate_proj.group
    x2, res = _bf16((1, 128), 11).to(DEV), _bf16((1, 128), 12).to(DEV)
    xp, xt, ss = resnorm.produce(res, o.run(x2), layer.post_attention_layernorm.weight)
    want = fused.silu_mul(resnorm.consume(gu.run(xt), ss, 1e-6))[0]
    _failing_kernels(monkeypatch, ValueError("not these operands (test)"))
    assert o.rn_out(x2, res, layer.post_attention_layernorm) is None and gpu_linear.RN_STATE["ok"]
    assert torch.equal(gu.rn_in(xt, ss, 1e-6, silu_out=True), want) and gpu_linear.RN_STATE["ok"]
    _failing_kernels(monkeypatch, RuntimeError("NVRTC refused RN_OUT (test)"))
    with pytest.warns(UserWarning, match="RN_OUT / RN_IN build failed"):
        assert o.rn_out(x2, res, layer.post_attention_layernorm) is None
    assert not gpu_linear.RN_STATE["ok"] and not o.rn_takes(1, x2.device, out=True)
    _failing_kernels(monkeypatch, RuntimeError("the driver refused RN_IN (test)"))
    with pytest.warns(UserWarning, match="RN_OUT / RN_IN build failed"):
        assert torch.equal(gu.rn_in(xt, ss, 1e-6, silu_out=True), want)
    assert not gpu_linear.RN_STATE["ok"]


def test_the_step_runs_unsplit_after_a_failing_kernel(monkeypatch):
    """RESNORM on, the first RN launch of the step failing: the step warns, runs every norm unsplit from there
    and decodes the unsplit step's bits."""
    monkeypatch.setattr(gpu_linear, "TUNE", False)
    s = Sampler(tiny(WIDE, "nvfp4-w4a16"), kv_cache="bf16", device=DEV, dtype=torch.bfloat16,
                eos_token_ids=[], kernels=True)
    forced = torch.randint(0, V, (1, 2), generator=torch.Generator().manual_seed(13))
    prompts = PROMPTS[:1]
    monkeypatch.setattr(gpu_decode_cases, "PROMPTS", prompts)
    base = teacher_forced_logits(s, forced)
    _failing_kernels(monkeypatch, RuntimeError("NVRTC refused RN_OUT (test)"))
    monkeypatch.setattr(gpu_decode, "RESNORM", True)
    s.engine.reset_graphs()
    with pytest.warns(UserWarning, match="RN_OUT / RN_IN build failed"):
        got = teacher_forced_logits(s, forced)
    assert not gpu_linear.RN_STATE["ok"] and torch.equal(got, base)


def test_the_fused_step_splits_the_norms(monkeypatch):
    """With RESNORM on (the sites' torch stand-ins where no kernel runs: RN_EMULATE) a one-row step runs every
    norm but the first and the last split over the GEMMs around it: L o_proj and L - 1 down_proj producers,
    as many q/k/v and gate | up consumers, no add_rmsnorm between; its logits within the norms' rounding of
    the unsplit step's; off, the unsplit step's bits."""
    monkeypatch.setattr(gpu_linear, "TUNE", False)
    cfg = RN_MODEL if DEV == "cuda" else WIDE  # (on CPU the stand-ins take any shape: the small model)
    s = Sampler(tiny(cfg, "nvfp4-w4a16"), kv_cache="bf16", device=DEV, dtype=torch.bfloat16,
                eos_token_ids=[], kernels=True)
    forced = torch.randint(0, V, (len(PROMPTS), 2), generator=torch.Generator().manual_seed(9))
    base = teacher_forced_logits(s, forced)
    calls = {"out": 0, "in": 0, "norm": 0}
    for name, key in (("rn_out_run", "out"), ("rn_in_run", "in")):
        real = getattr(gpu_linear, name)
        monkeypatch.setattr(gpu_linear, name, lambda *a, _r=real, _k=key, **kw: calls.__setitem__(
            _k, calls[_k] + 1) or _r(*a, **kw))
    real_norm = fused.add_rmsnorm
    monkeypatch.setattr(fused, "add_rmsnorm", lambda *a, **kw: calls.__setitem__("norm", calls["norm"] + 1)
                        or real_norm(*a, **kw))
    monkeypatch.setattr(gpu_linear, "RN_EMULATE", True)
    monkeypatch.setattr(gpu_decode, "RESNORM", True)
    s.engine.reset_graphs()
    split = teacher_forced_logits(s, forced)
    layers = cfg["num_hidden_layers"]
    steps = calls["norm"] // 2  # the first and the last norm of each step still launch add_rmsnorm
    assert steps >= 2 and calls["norm"] == 2 * steps
    assert calls["out"] == (2 * layers - 1) * steps and calls["in"] == calls["out"]
    rel = ((split - base).float().norm(dim=-1) / base.float().norm(dim=-1)).max().item()
    assert 0 < rel < 2e-2, rel
    monkeypatch.setattr(gpu_decode, "RESNORM", False)
    s.engine.reset_graphs()
    assert torch.equal(teacher_forced_logits(s, forced), base)


# ------------------------------------------------------------------------------------------------ GPU


def _gpu_weight(n, k, seed):
    w = reference.quantize((torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).cuda())
    return w, gemv_cuda.relayout(w.data, w.block_scale)


# (N, K, configuration, rows): the one-row plans of Qwen3-8B's o_proj / down_proj (KW 8) and a KW 4 / 2
# build; 3 and 8 rows (elements past a thread's first: the epilogue's loop and its residual loads there)
_KW = dict(NT=1, MG=1, SPLIT=1, DEPTH=2)
_OUT = [(4096, 4096, None, 1), (4096, 12288, None, 1), (2048, 1024, dict(_KW, KW=4), 3),
        (1024, 2048, dict(_KW, KW=2), 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,cfg,m", _OUT)
def test_gpu_producer_is_resnorm_produce_of_the_plain_launch(n, k, cfg, m):
    """RN_OUT's x', xt and tile sums equal resnorm.produce(r, the plain launch's y, w) bit for bit (y's place
    holds xt), eagerly and in a CUDA graph."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    w, wc = _gpu_weight(n, k, seed=n + k)
    x = _bf16((m, k), 5).cuda()
    r = _bf16((m, n), 6, 3.0).cuda()
    nw = (1 + 0.2 * torch.randn(n, generator=torch.Generator().manual_seed(7))).bfloat16().cuda()
    cfg = cfg or gemv_cuda._plan(n, k, m, 0)
    y = gemv_cuda.launch(x, wc, w.global_scale, torch.empty(m, n, dtype=torch.bfloat16, device="cuda"),
                         cfg=cfg)
    want = resnorm.produce(r, y, nw)
    for graph in (False, True):
        xo = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        xt = torch.full_like(xo, float("nan"))
        ss = torch.full((m, n // 16), float("nan"), device="cuda")
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                gemv_cuda.launch(x, wc, w.global_scale, xt, cfg=cfg, rn_out=(r, xo, nw, ss))
            g.replay()
        else:
            gemv_cuda.launch(x, wc, w.global_scale, xt, cfg=cfg, rn_out=(r, xo, nw, ss))
        torch.cuda.synchronize()
        assert torch.equal(xo, want[0]) and torch.equal(xt, want[1]) and torch.equal(ss, want[2]), graph


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,cfg,m,silu", [(6144, 4096, None, 1, False), (24576, 4096, None, 1, True),
                                             (2048, 1024, dict(_KW, KW=4), 5, True),
                                             (19456, 2560, None, 1, True), (2048, 1024, _KW, 3, False),
                                             (1024, 512, dict(_KW, KW=2), 8, False)])
@pytest.mark.parametrize("at", [1, 2])
def test_gpu_consumer_is_the_plain_launch_times_rstd(n, k, cfg, m, silu, at, monkeypatch):
    """RN_IN (and with GU_SILU): with tile sums that make rstd = 2 exactly (eps 0), y = 2 * the plain launch's
    y bit for bit (silu_mul of it with GU_SILU); with random sums (in a CUDA graph), y = bf16(y_plain *
    resnorm.rstd) up to the one rounding y_plain carries (per-row global scales, as a fused q/k/v's). Both
    places rstd is made (RN_IN 1: before the stream, from L2; 2: after it, from shared memory)."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    monkeypatch.setattr(gemv_cuda, "RN_IN_AT", at)
    w, wc = _gpu_weight(n, k, seed=n + 2 * k)
    x = _bf16((m, k), 8).cuda()
    g = (w.global_scale.float().reshape(1) * (0.5 + torch.rand(n, generator=torch.Generator().manual_seed(9))
                                              .cuda())).contiguous()
    cfg = cfg or gemv_cuda._plan(n, k, m, 0)
    y = gemv_cuda.launch(x, wc, g, torch.empty(m, n, dtype=torch.bfloat16, device="cuda"), cfg=cfg)
    out_n = n // 2 if silu else n
    two = torch.full((m, k // 16), 4.0, device="cuda")  # sum = K / 4: rstd = 1 / sqrt(1 / 4) = 2
    got = torch.full((m, out_n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemv_cuda.launch(x, wc, g, got, cfg=cfg, silu_out=silu, rn_in=(two, 0.0))
    want = (y.float() * 2).bfloat16()
    assert torch.equal(got, fused.silu_mul(want)[0] if silu else want)
    ss = torch.rand(m, k // 16, generator=torch.Generator().manual_seed(10)).cuda() * 3
    rstd = resnorm.rstd(ss, k, 1e-6)
    got = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv_cuda.launch(x, wc, g, got, cfg=cfg, rn_in=(ss, 1e-6))
    graph.replay()
    torch.cuda.synchronize()
    approx = (y.float() * rstd[:, None]).bfloat16()
    ulp = torch.exp2(torch.floor(torch.log2(approx.float().abs().clamp_min(1e-30))) - 7)
    assert ((got.float() - approx.float()).abs() <= ulp).all()
    agree = (got == approx).float().mean().item()
    assert 0.6 < agree < 0.95, agree  # one rounding, not two (which would agree everywhere): 0.73-0.74, H100


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,cfg,silu", [(6144, 4096, None, False), (24576, 4096, None, True),
                                          (19456, 2560, None, True), (2048, 1024, dict(_KW, KW=4), True),
                                          (1024, 512, _KW, False)])
@pytest.mark.parametrize("at", [1, 2])
def test_gpu_consumer_rstd_bit_for_bit(n, k, cfg, silu, at, monkeypatch):
    """With one-hot rows of x and power-of-two per-row global scales the plain launch's sums are exact, so
    RN_IN's y = bf16((acc g) rstd) is bf16(y_plain * resnorm.rstd) bit for bit, rstd from random tile sums per
    row (its sum order and row indexing; silu_mul of it with GU_SILU), 1-8 rows, both places rstd is made."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    monkeypatch.setattr(gemv_cuda, "RN_IN_AT", at)
    _, wc = _gpu_weight(n, k, seed=n + 3 * k)
    gen = torch.Generator().manual_seed(n + at)
    g = torch.exp2(torch.randint(-3, 4, (n,), generator=gen).float()).cuda()
    for m in ((1,) if cfg is None else (1, 3, 8)):
        run_cfg = cfg or gemv_cuda._plan(n, k, m, 0)
        x = torch.zeros(m, k, dtype=torch.bfloat16)
        x[torch.arange(m), torch.randint(0, k, (m,), generator=gen)] = 1.0
        x = x.cuda()
        y = gemv_cuda.launch(x, wc, g, torch.empty(m, n, dtype=torch.bfloat16, device="cuda"), cfg=run_cfg)
        scales = torch.exp2(torch.randint(-6, 6, (m, k // 16), generator=gen).float())
        ss = (torch.rand(m, k // 16, generator=gen) * scales).cuda()
        want = (y.float() * resnorm.rstd(ss, k, 1e-6)[:, None]).bfloat16()
        got = torch.full((m, n // 2 if silu else n), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemv_cuda.launch(x, wc, g, got, cfg=run_cfg, silu_out=silu, rn_in=(ss, 1e-6))
        assert torch.equal(got, fused.silu_mul(want)[0] if silu else want), (m, at)


@pytest.mark.gpu
def test_gpu_greedy_decoding_with_the_split_norms(monkeypatch):
    """One prompt decoded greedily under CUDA graphs with RESNORM on (every norm but the first and last
    split: the kernels take every GEMM of RN_MODEL at one row; 2L - 1 producer and as many consumer launches a
    step) and off: the same tokens up to the first that parts, log-probs within 0.05 there."""
    monkeypatch.setattr(gpu_linear, "TUNE", False)
    launched = []
    real = gemv_cuda.launch
    monkeypatch.setattr(gemv_cuda, "launch", lambda *a, **kw: launched.append(
        "out" if kw.get("rn_out") else "in" if kw.get("rn_in") else "") or real(*a, **kw))
    outs = []
    for on in (True, False):
        monkeypatch.setattr(gpu_decode, "RESNORM", on)
        launched.clear()
        s = Sampler(tiny(RN_MODEL, "nvfp4-w4a16"), kv_cache="bf16", device="cuda", eos_token_ids=[])
        out = s.generate([[5, 17, 99, 3]], SamplingParams(greedy=True, max_new_tokens=8))
        assert s.engine.graph_error is None and s.engine.counts["replays"] > 0
        pairs = launched.count("out")
        per_step = 2 * RN_MODEL["num_hidden_layers"] - 1
        assert (pairs > 0 and launched.count("in") == pairs and pairs % per_step == 0) == on, launched[:8]
        outs.append(out[0])
    assert gpu_linear.RN_STATE["ok"]
    a, b = outs
    same = 0  # the tokens before the first that parts (each chosen from the same context in both)
    while same < min(len(a.completion_ids), len(b.completion_ids)) and \
            a.completion_ids[same] == b.completion_ids[same]:
        same += 1
    assert same >= 1 and max(abs(p - q) for p, q in zip(a.logprobs[:same], b.logprobs[:same])) < 0.05

"""The dense MLP's SiLU(gate) * up in the gate/up GEMM's epilogue (gemv_mma16.cu GU_SILU; gemv_cuda.launch(
silu_out=True), gemm.gemm(silu_out=True), the fused decode step's gate/up site `silu_run`).

On CPU: which configurations take it (gu_silu_ok), its shared memory, gemm(silu_out=True) and the fused step
on the paths without the kernel (fused.silu_mul after the GEMM: the definition the kernel must match). On the
GPU (-m gpu): the GU_SILU launch against fused.silu_mul of the plain launch, bit for bit, on every epilogue it
has (SPLIT 1, the in-CTA split, the cluster's ranks; mma.sync and wgmma), with one and with per-row global
scales, under a CUDA graph; the dispatch; greedy decoding with it on and off."""

import pytest
import torch
from gpu_decode_cases import DEV, PROMPTS, WIDE, V, teacher_forced_logits, tiny  # (first: TRITON_INTERPRET)

from fp4rl import gpu_linear  # noqa: E402
from fp4rl.kernels import fused, gemm, gemv_cuda  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402
from fp4rl.sampler import Sampler, SamplingParams  # noqa: E402

SMS = 132


def _weight(n, k, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[: n // 4, :16] *= 1e-4  # tiny blocks: subnormal E4M3 scales
    return reference.quantize(w.to(device))


@pytest.mark.parametrize("n,k", [(24576, 4096), (19456, 2560), (34816, 5120)])
def test_the_qwen3_gate_up_at_one_row_takes_the_epilogue(n, k):
    """Qwen3-8B / 4B / 14B's fused gate | up at one row (the in-CTA split at 8B / 14B, the plain build at 4B)
    is a GU_SILU configuration; its shared memory holds the pairs' staging."""
    cfg = gemv_cuda.choose(n, k, 1, SMS)
    assert gemv_cuda.gu_silu_ok(cfg, n), cfg
    fused_cfg = {**cfg, "GU_SILU": 1}
    # the epilogue's fp32 staging: [KW k ranges (1 without the in-CTA split)][8 MG rows][NB + 4 columns]
    staging = cfg.get("KW", 1) * 8 * cfg["MG"] * (gemv_cuda.block_rows(cfg) + 4) * 4
    assert gemv_cuda.smem_bytes(fused_cfg, k, 1) >= staging
    assert gemv_cuda.smem_bytes(dict(fused_cfg, MG=8), k, 64) >= 8 * 8 * (gemv_cuda.block_rows(cfg) + 4) * 4
    assert gemv_cuda.smem_bytes(fused_cfg, k, 1) <= gemv_cuda.SMEM_LIMIT


def test_gu_silu_ok_refuses_what_the_epilogue_cannot_pair():
    plain = dict(NT=1, MG=1, SPLIT=1, DEPTH=2)
    assert gemv_cuda.gu_silu_ok(plain, 2048)  # 128 rows a CTA: 64 gate rows divide I = 1024
    assert gemv_cuda.gu_silu_ok(dict(plain, KW=4), 2048)  # 32 rows a CTA, 16 of each
    assert gemv_cuda.gu_silu_ok(dict(plain, SPLIT=8), 2048)  # the cluster: each rank finishes 8 pairs
    assert gemv_cuda.gu_silu_ok(dict(plain, WGMMA=1, XSTREAM=1, SWZ=1, WARPS=4), 2048)  # 32 of each a CTA
    assert not gemv_cuda.gu_silu_ok(dict(plain, KW=8), 2048)  # one n-tile a CTA: no pair in it
    assert not gemv_cuda.gu_silu_ok(dict(plain, WGMMA=1, XSTREAM=1, SWZ=1, WS=1), 2048)  # (the WS build)
    for key in ("GSR", "PRENORM", "SILU", "GROUPED"):  # builds the kernel's GU_SILU does not compile with
        assert not gemv_cuda.gu_silu_ok(dict(plain, KW=2, **{key: 1}), 2048), key
    assert not gemv_cuda.gu_silu_ok(plain, 2048 + 32)  # I = 1040: 64 gate rows a CTA do not divide it
    assert not gemv_cuda.gu_silu_ok(plain, 48)  # N not a multiple of 32 (two whole n-tiles)


def test_launch_refuses_silu_out_where_there_is_no_build():
    """A configuration without the epilogue (one n-tile a CTA) or W4A4 (x_scale) is a ValueError that says
    what to run instead, before anything touches a device."""
    w = _weight(256, 512)
    wc = gemv_cuda.relayout(w.data, w.block_scale)
    x = torch.zeros(1, 512, dtype=torch.bfloat16)
    y = torch.empty(1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no GU_SILU build"):
        gemv_cuda.launch(x, wc, w.global_scale, y, cfg=dict(NT=1, MG=1, SPLIT=1, DEPTH=2, KW=8),
                         silu_out=True)
    with pytest.raises(ValueError, match="W4A4"):
        gemv_cuda.launch(x, wc, w.global_scale, y, cfg=dict(NT=1, MG=1, SPLIT=1, DEPTH=2), silu_out=True,
                         x_scale=torch.ones(1))
    with pytest.raises(ValueError, match=r"y must be \[1, 128\]"):
        gemv_cuda.launch(x, wc, w.global_scale, torch.empty(1, 256, dtype=torch.bfloat16),
                         cfg=dict(NT=1, MG=1, SPLIT=1, DEPTH=2), silu_out=True)


def test_gemm_silu_out_is_silu_mul_of_the_gemm():
    """Without the kernel (here: the CPU) gemm(silu_out=True) is fused.silu_mul of the plain GEMM, per-row
    global scales included (a fused gate | up's two members); bad calls are refused."""
    gate, up = _weight(64, 128, seed=1), _weight(64, 128, seed=2)
    from types import SimpleNamespace

    g_rows = torch.cat([gate.global_scale.float().reshape(1).expand(64), up.global_scale.float().reshape(1)
                        .expand(64) * 3.0])
    w = SimpleNamespace(data=torch.cat([gate.data, up.data]),
                        block_scale=torch.cat([gate.block_scale, up.block_scale]), global_scale=g_rows)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    y = gemm.gemm(x, w, tune=False)
    a = gemm.gemm(x, w, tune=False, silu_out=True)
    assert a.shape == (3, 64) and torch.equal(a, fused.silu_mul(y)[0])
    assert not torch.equal(a, fused.silu_mul(y.flip(1))[0])  # (which half is gate matters)
    with pytest.raises(ValueError, match="silu_out=True is for a dense W4A16"):
        gemm.gemm(x, w, silu_out=True, silu=True)
    odd = SimpleNamespace(data=gate.data[:47], block_scale=gate.block_scale[:47],
                          global_scale=gate.global_scale)
    with pytest.raises(ValueError, match="even N"):
        gemm.gemm(x, odd, silu_out=True)


def test_the_fused_step_runs_gate_up_with_silu_out(monkeypatch):
    """A W4A16 dense model's fused decode step calls its gate | up groups' silu_run (one call a layer and
    step, no separate silu_mul in the step) and decodes the module step's logits; with FP4RL_GU_SILU off
    too."""
    monkeypatch.setattr(gpu_linear, "TUNE", False)
    calls = []
    real = gpu_linear.KernelFusedGroup.silu_run
    monkeypatch.setattr(gpu_linear.KernelFusedGroup, "silu_run",
                        lambda self, x2: calls.append(x2.shape[0]) or real(self, x2))
    s = Sampler(tiny(WIDE, "nvfp4-w4a16"), kv_cache="bf16", device=DEV, dtype=torch.bfloat16,
                eos_token_ids=[], kernels=True)
    assert s.engine.fused and all(p.gate_up.silu_run is not None for p in s.engine.plans)
    forced = torch.randint(0, V, (len(PROMPTS), 2), generator=torch.Generator().manual_seed(9))
    a = teacher_forced_logits(s, forced)
    assert calls and len(calls) % WIDE["num_hidden_layers"] == 0
    monkeypatch.setattr(gemm, "FUSED_GU_SILU", False)
    s.engine.reset_graphs()
    b = teacher_forced_logits(s, forced)
    assert torch.equal(a, b)
    assert not s.engine.set_fused(False)
    c = teacher_forced_logits(s, forced)
    if DEV == "cpu":
        assert torch.equal(a, c)
    else:
        assert ((a - c).norm(dim=-1) / c.norm(dim=-1)).max().item() < 1e-2


def test_row_scales_early_are_a_key_of_per_row_gate_ups_only(monkeypatch):
    """With GU_SILU_EARLY (FP4RL_GU_SILU_GSR=1) a GU_SILU launch with per-row global scales compiles the GSU
    build where gsu_ok takes the configuration; one global scale, the cluster, or the switch off: no GSU."""
    w = _weight(256, 512)
    wc = gemv_cuda.relayout(w.data, w.block_scale)
    x = torch.zeros(1, 512, dtype=torch.bfloat16)
    keys = []

    class Compiled(Exception):
        pass

    def kernel(key, dev):
        keys.append(dict(key[:-3]))
        raise Compiled

    monkeypatch.setattr(gemv_cuda, "_kernel", kernel)
    monkeypatch.setattr(gemv_cuda, "cuda_index", lambda t: 0)
    rows = torch.rand(256) + 0.5
    plain, cluster = dict(NT=1, MG=1, SPLIT=1, DEPTH=2, KW=2), dict(NT=1, MG=1, SPLIT=2, DEPTH=2)
    for on, g, cfg, want in ((True, rows, plain, True), (True, w.global_scale, plain, False),
                             (True, rows, cluster, False), (False, rows, plain, False)):
        monkeypatch.setattr(gemv_cuda, "GU_SILU_EARLY", on)
        with pytest.raises(Compiled):
            gemv_cuda.launch(x, wc, g, torch.empty(1, 128, dtype=torch.bfloat16), cfg=cfg, silu_out=True)
        assert bool(keys[-1].get("GSU")) == want, (on, g.numel(), cfg)


# ------------------------------------------------------------------------------------------------ GPU


def _gpu_gate_up(i, k, seed):
    """A fused gate | up weight [2I, K] on the GPU (two quantized members), its mma16 copy, its global scale
    as one value, per row as KernelFusedGroup passes them (gate's and up's own scales), and random per row
    (every row its own: a row scale read from the wrong row shows)."""
    gate, up = _weight(i, k, seed=seed, device="cuda"), _weight(i, k, seed=seed + 1, device="cuda")
    data, scale = torch.cat([gate.data, up.data]), torch.cat([gate.block_scale, up.block_scale])
    wc = gemv_cuda.relayout(data, scale)
    g1 = gate.global_scale.float().reshape(1)
    g_rows = torch.cat([g1.expand(i), (up.global_scale.float().reshape(1) * 0.37).expand(i)]).contiguous()
    g_rand = (g1 * (torch.rand(2 * i, generator=torch.Generator().manual_seed(seed + 2)) + 0.5).cuda())
    return data, scale, wc, g1, g_rows, g_rand.contiguous()


# (configuration, rows): mma.sync plain (NT 1 / 2), in-CTA split (KW 2 / 4), two row groups (x staged /
# streamed), the cluster (SPLIT 2 / 4); wgmma (sm_90a): choose_narrow's (one warpgroup, SPLIT 1 / 2), one and
# two warpgroups at 17-32 rows (choose_wide's), two row blocks
_MMA = [(dict(NT=1, MG=1, SPLIT=1, DEPTH=2), (1, 3, 8)), (dict(NT=2, MG=1, SPLIT=1, DEPTH=2), (1, 8)),
        (dict(NT=1, MG=1, SPLIT=1, DEPTH=2, KW=2), (1, 5)),
        (dict(NT=1, MG=1, SPLIT=1, DEPTH=3, KW=4), (1, 8)),
        (dict(NT=1, MG=2, SPLIT=1, DEPTH=2), (9, 16)),
        (dict(NT=1, MG=2, SPLIT=1, DEPTH=2, XSTREAM=1), (9, 16)),
        (dict(NT=1, MG=1, SPLIT=2, DEPTH=2), (1, 2, 8)),
        (dict(NT=1, MG=2, SPLIT=4, DEPTH=2, XSTREAM=1), (16,))]
_WIDE = dict(XSTREAM=1, WGMMA=1, SWZ=1)
_WGMMA = [(dict(NT=1, MG=1, SPLIT=1, DEPTH=3, WARPS=4, **_WIDE), (2, 8)),
          (dict(NT=1, MG=1, SPLIT=2, DEPTH=3, WARPS=4, **_WIDE), (2, 4, 8)),
          (dict(NT=1, MG=2, SPLIT=2, DEPTH=2, WARPS=4, **_WIDE), (9, 16)),
          (dict(NT=1, MG=3, SPLIT=2, DEPTH=2, WARPS=4, **_WIDE), (17, 24)),
          (dict(NT=1, MG=4, SPLIT=2, DEPTH=2, **_WIDE), (25, 32, 40))]


@pytest.mark.gpu
@pytest.mark.parametrize("i,k", [(1024, 1280), (4096, 2048)])
def test_gpu_gu_silu_is_silu_mul_of_the_plain_launch(i, k):
    """The epilogue's a = silu_mul(y) equals fused.silu_mul of the same configuration's plain launch, bit for
    bit, on every epilogue (SPLIT 1, the in-CTA split, the cluster's ranks) of the mma.sync and wgmma builds,
    at 1-40 rows, one and per-row global scales; the default plan at one row in a CUDA graph."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    n = 2 * i
    _, _, wc, g1, g_rows, g_rand = _gpu_gate_up(i, k, seed=11)
    base = torch.randn(40, k, generator=torch.Generator().manual_seed(12)).bfloat16().cuda() * 2
    cases = _MMA + (_WGMMA if gemv_cuda.wide_available() else [])
    checked = 0
    for cfg, rows in cases:
        assert gemv_cuda.gu_silu_ok(cfg, n), cfg
        for m in rows:
            x = base[:m]
            for g in (g1, g_rows, g_rand):
                y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                gemv_cuda.launch(x, wc, g, y, cfg=cfg)
                want = fused.silu_mul(y)[0]
                a = torch.full((m, i), float("nan"), dtype=torch.bfloat16, device="cuda")
                gemv_cuda.launch(x, wc, g, a, cfg=cfg, silu_out=True)
                assert not y.isnan().any() and torch.equal(a, want), (cfg, m, g.numel())
                checked += 1
    assert checked == 3 * sum(len(rows) for _, rows in cases)
    # the default plan at one row, eagerly and replayed in a CUDA graph
    x = base[:1]
    y = gemv_cuda.launch(x, wc, g_rows, torch.empty(1, n, dtype=torch.bfloat16, device="cuda"))
    want = fused.silu_mul(y)[0]
    a = torch.full((1, i), float("nan"), dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv_cuda.launch(x, wc, g_rows, a, silu_out=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(a, want)


@pytest.mark.gpu
@pytest.mark.parametrize("i,k", [(12288, 4096), (9728, 2560)])
def test_gpu_gu_silu_on_the_qwen3_shapes(i, k):
    """Qwen3-8B's gate | up (the in-CTA split at one row) and Qwen3-4B's (the plain build): the default
    one-row launch with silu_out against fused.silu_mul of the plain one."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    _, _, wc, _, g_rows, _ = _gpu_gate_up(i, k, seed=21)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(22)).bfloat16().cuda()
    y = gemv_cuda.launch(x, wc, g_rows, torch.empty(1, 2 * i, dtype=torch.bfloat16, device="cuda"))
    a = torch.full((1, i), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemv_cuda.launch(x, wc, g_rows, a, silu_out=True)
    assert torch.equal(a, fused.silu_mul(y)[0])


@pytest.mark.gpu
def test_gpu_gemm_silu_out_dispatch(monkeypatch):
    """gemm.gemm(silu_out=True) takes the GU_SILU launch wherever gemm's own mma16 launch has it (1-16 rows,
    wide_rows), runs silu_mul after the GEMM elsewhere (100 rows: the tuner's kernels), with FUSED_GU_SILU
    off, and after a failing build (warned, then off): the same bits each way."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    from types import SimpleNamespace

    i, k = 1024, 1280
    data, scale, wc, _, g_rows, _ = _gpu_gate_up(i, k, seed=31)
    w = SimpleNamespace(data=data, block_scale=scale, global_scale=g_rows, mma16=wc)
    fused_calls = []
    real = gemv_cuda.launch
    monkeypatch.setattr(gemv_cuda, "launch", lambda *a, **kw: fused_calls.append(kw.get("silu_out", False))
                        or real(*a, **kw))
    for m in (1, 4, 16, 24, 100):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16().cuda()
        want = fused.silu_mul(gemm.gemm(x, w, tune=False))[0]
        fused_calls.clear()
        assert torch.equal(gemm.gemm(x, w, tune=False, silu_out=True), want), m
        wide = gemm.wide_rows(m, 2 * i) and gemv_cuda.wide_available()
        plan = (gemv_cuda._plan(2 * i, k, m, 0) if m <= gemm.MMA16_MAX_ROWS
                else gemv_cuda._plan_wide(2 * i, k, m, 0) if wide else None)
        assert (True in fused_calls) == (plan is not None and gemv_cuda.gu_silu_ok(plan, 2 * i)), m
        assert m > 1 or True in fused_calls  # (one row: the epilogue, whatever the plan)
    x = torch.randn(1, k, device="cuda").bfloat16()
    want = fused.silu_mul(gemm.gemm(x, w, tune=False))[0]
    monkeypatch.setattr(gemm, "FUSED_GU_SILU", False)
    fused_calls.clear()
    assert torch.equal(gemm.gemm(x, w, tune=False, silu_out=True), want) and True not in fused_calls
    monkeypatch.setattr(gemm, "FUSED_GU_SILU", True)

    def broken(*a, **kw):
        if kw.get("silu_out"):
            raise RuntimeError("NVRTC refused GU_SILU (test)")
        return real(*a, **kw)

    monkeypatch.setattr(gemv_cuda, "launch", broken)
    with pytest.warns(UserWarning, match="GU_SILU build failed"):
        assert torch.equal(gemm.gemm(x, w, tune=False, silu_out=True), want)
    assert gemm.FUSED_GU_SILU is False and gemv_cuda.available()  # the plain kernel stays on


@pytest.mark.gpu
def test_gpu_greedy_decoding_with_and_without_the_epilogue(monkeypatch):
    """One prompt (one row: the gate | up takes GU_SILU) decoded greedily under CUDA graphs with the epilogue
    and with FP4RL_GU_SILU off: the same tokens and log-probs."""
    monkeypatch.setattr(gpu_linear, "TUNE", False)
    launched = []
    real = gemv_cuda.launch
    monkeypatch.setattr(gemv_cuda, "launch", lambda *a, **kw: launched.append(kw.get("silu_out", False))
                        or real(*a, **kw))
    outs = []
    for on in (True, False):
        monkeypatch.setattr(gemm, "FUSED_GU_SILU", on)
        launched.clear()
        s = Sampler(tiny(WIDE, "nvfp4-w4a16"), kv_cache="bf16", device="cuda", eos_token_ids=[])
        out = s.generate([[5, 17, 99, 3]], SamplingParams(greedy=True, max_new_tokens=8))
        assert s.engine.graph_error is None and s.engine.counts["replays"] > 0
        assert (True in launched) == on  # the step's gate | up took the epilogue (or, off, never)
        outs.append(out)
    assert outs[0][0].completion_ids == outs[1][0].completion_ids
    assert outs[0][0].logprobs == outs[1][0].logprobs


@pytest.mark.gpu
@pytest.mark.parametrize("i,k", [(12288, 4096), (9728, 2560), (1024, 1280)])
def test_gpu_gu_silu_row_scales_early_are_the_same_bits(i, k, monkeypatch):
    """GSU (FP4RL_GU_SILU_GSR=1: the gate and up row scales read before the stream) gives the default GU_SILU
    launch's bits: the one-row plans of Qwen3-8B's (in-CTA split) and 4B's (plain) gate | up, and the plain
    and KW 2 / 4 builds at 1-8 rows, with the group's per-row scales and random ones."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    _, _, wc, _, g_rows, g_rand = _gpu_gate_up(i, k, seed=41)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(42)).bfloat16().cuda()
    small = [dict(NT=1, MG=1, SPLIT=1, DEPTH=2), dict(NT=1, MG=1, SPLIT=1, DEPTH=2, KW=2),
             dict(NT=1, MG=1, SPLIT=1, DEPTH=3, KW=4)]
    cfgs = [None] if i != 1024 else small
    for cfg in cfgs:
        for m in (1,) if cfg is None else (1, 5, 8):
            for g in (g_rows, g_rand):
                out = []
                for on in (False, True):
                    monkeypatch.setattr(gemv_cuda, "GU_SILU_EARLY", on)
                    a = torch.full((m, i), float("nan"), dtype=torch.bfloat16, device="cuda")
                    out.append(gemv_cuda.launch(x[:m], wc, g, a, cfg=cfg, silu_out=True))
                assert not out[0].isnan().any() and torch.equal(out[0], out[1]), (cfg, m)

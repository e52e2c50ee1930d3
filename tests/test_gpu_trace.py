"""TRACE guidance recorded by the kernel engine (fp4rl/gpu_trace.py, fp4rl/kernels/trace_record.py): the
record kernel's bytes against trace.compact, the engine's guided generate against the eager sampler's (keys,
shapes, the rows of an input both compute alike) and, the point of it, the trainer guided by the engine's
guidance scoring the engine's tokens as the engine did. On a machine without CUDA the kernels run in Triton's
interpreter (gpu_decode_cases)."""

import pytest
import torch
from gpu_decode_cases import DENSE, DEV, MOE, PROMPTS, _pair, tiny  # (before fp4rl: TRITON_INTERPRET)

from fp4rl import trace  # noqa: E402
from fp4rl.grpo import token_logprobs  # noqa: E402
from fp4rl.kernels.trace_record import record  # noqa: E402
from fp4rl.nvfp4 import quantize  # noqa: E402
from fp4rl.sampler import SamplingParams  # noqa: E402


@pytest.mark.parametrize("k", [16, 48, 2064])
def test_record_kernel_writes_the_compact_guidance(k):
    """Bits, block scales and amax equal trace.compact's for the same x and Q(x) (K of one block, of blocks
    not filling the kernel's chunk, of two chunks); src gathers rows; a NaN row keeps amax NaN, as torch's."""
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(5, k, generator=g) * torch.logspace(-1, 1, k)).to(torch.bfloat16).to(DEV)
    q = quantize(x, scale_rule="6", scale_scope="row")
    want = trace.compact(x, q)
    bits, scales, amax = record(x, q.data, q.block_scale)
    assert torch.equal(bits.cpu(), want.bits)
    assert torch.equal(scales.cpu().view(torch.uint8), want.block_scale.view(torch.uint8))
    assert torch.equal(amax.cpu(), want.amax)
    src = torch.tensor([3, 0, 3, 4], dtype=torch.int32, device=DEV)
    bits, scales, amax = record(x, q.data, q.block_scale, src)
    assert torch.equal(bits.cpu(), want.bits[src.long().cpu()])
    assert torch.equal(amax.cpu(), want.amax[src.long().cpu()])
    y = x.clone()
    y[1, k // 2] = float("nan")
    y[3, 0] = float("-inf")
    amax = record(y, q.data, q.block_scale)[2].cpu()
    assert torch.equal(amax.isnan(), torch.tensor([0, 1, 0, 0, 0]).bool()) and amax[3] == float("inf")


def test_record_kernel_refuses_shapes_that_do_not_fit():
    x = torch.zeros(2, 24, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        record(x, torch.zeros(2, 12, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.float8_e4m3fn))
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"data \[R, K/2\]"):
        record(x, torch.zeros(3, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="src must be a 1-D int32/int64"):
        record(x, torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.float8_e4m3fn),
               torch.zeros(2, dtype=torch.float32))


def _trainer_gap(trainer, completions, guided: bool) -> float:
    """Mean |trainer logprob - sampler logprob| over the completions' tokens (routing replayed), the
    trainer guided by each completion's guidance or rounding to nearest."""
    diffs = []
    for c in completions:
        n = len(c.prompt_ids) + len(c.completion_ids) - 1
        ids = torch.tensor([c.prompt_ids + c.completion_ids])
        kw = {} if c.routing is None else {"routing": [r[None] for r in c.routing]}
        g = {k: trace.Guidance.from_dict({f: v[None].cpu() for f, v in d.items()})
             for k, d in c.guidance.items()}
        with torch.no_grad():
            if guided:
                with trace.guiding(trainer, g, torch.ones(1, n, dtype=torch.bool)):
                    logits = trainer(ids[:, :-1], **kw)
            else:
                logits = trainer(ids[:, :-1], **kw)
        lp = token_logprobs(logits.float(), ids[:, 1:])[0, len(c.prompt_ids) - 1:]
        diffs.append((lp - torch.tensor(c.logprobs)).abs())
    return torch.cat(diffs).mean().item()


@pytest.mark.parametrize("config,contract", [
    (DENSE, "nvfp4-linear"),
    (dict(MOE, num_hidden_layers=3, mlp_only_layers=(1,)), "nvfp4-experts"),  # a dense layer between
])
def test_engine_guidance_guides_the_trainer_to_the_engines_tokens(config, contract):
    """A guided generate on the kernel engine (prefill through its modules, decode steps; rows leaving at EOS
    while the next step is already queued) returns each completion the eager sampler's guidance keys and
    shapes; where both compute an input alike (layer 0's q/k/v input: the embedding's RMSNorm) its bytes
    are the eager sampler's; and the trainer guided by it scores the engine's tokens ~10x closer to the
    engine's logprobs than rounding to nearest (measured: dense 0.26 -> 0.008, routed experts 0.08 ->
    0.009)."""
    fast, slow = _pair(config, contract, "bf16")
    params = SamplingParams(n=2, max_new_tokens=6, seed=2, guidance=1.0)
    fast.eos_token_ids = slow.eos_token_ids = set(range(0, 128, 5))  # some rows end early, others run on
    out, ref = fast.generate(PROMPTS, params), slow.generate(PROMPTS, params)
    assert fast.engine.counts["eager_steps"] + fast.engine.counts["replays"] > 0
    assert len({len(c.completion_ids) for c in out}) > 1, [len(c.completion_ids) for c in out]
    for c, r in zip(out, ref):
        assert sorted(c.guidance) == sorted(r.guidance)
        rows = len(c.prompt_ids) + len(c.completion_ids) - 1
        for k, g in c.guidance.items():
            assert g["amax"].shape[0] == rows
            for f in ("bits", "block_scale", "amax"):
                assert g[f].shape[1:] == r.guidance[k][f].shape[1:] and g[f].dtype == r.guidance[k][f].dtype
        first = "model.layers.0.self_attn.q_proj"
        if first in c.guidance:  # the prompt's rows: the same x, the same (byte-identical) quantizer
            p = len(c.prompt_ids)
            for f in ("bits", "block_scale", "amax"):
                assert torch.equal(c.guidance[first][f][:p].view(torch.uint8),
                                   r.guidance[first][f][:p].view(torch.uint8)), f
    trainer = tiny(config, contract)  # the sampler's weights, as the trainer holds them
    rtn, guided = _trainer_gap(trainer, out, False), _trainer_gap(trainer, out, True)
    assert guided < 0.03 and guided < rtn / 4, (rtn, guided)


def _guides(model) -> list:
    return [m for m in model.modules() if getattr(getattr(m, "group", None) or m, "trace_guide", None)]


def test_engine_guidance_on_off_and_refused_sites():
    """set_guidance(0) (an unguided generate) takes every Guide away: no guidance, no recording launches.
    Guidance left in the sink by a forward nobody took is not handed to the next generate. A guided linear
    the engine does not run on its kernels cannot record: refused by name, and nothing stays attached (the
    next guided generate attaches again)."""
    from fp4rl import trace
    from fp4rl.packed import PackedNVFP4Linear

    fast, _ = _pair(DENSE, "nvfp4-linear", "bf16")
    params = SamplingParams(max_new_tokens=2, guidance=1.0)
    first = fast.generate(PROMPTS[:1], params)
    assert _guides(fast.model) and fast.engine.sink is not None
    out = fast.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
    assert out[0].guidance is None and fast.engine.sink is None and fast.engine.take_guidance() is None
    assert not _guides(fast.model)
    half = fast.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, guidance=0.5))[0].guidance
    assert sorted(half) == sorted(k for k in first[0].guidance if ".layers.1." in k)  # the deeper half
    fast.generate(PROMPTS[:1], params)
    fast.engine.sink.got["stale"] = trace.Guidance.empty((1,), 16)  # (a forward whose guidance nobody took)
    assert sorted(fast.generate(PROMPTS[:1], params)[0].guidance) == sorted(first[0].guidance)
    o = fast.model.model.layers[0].self_attn.o_proj
    kernel_class, o.__class__ = o.__class__, PackedNVFP4Linear  # as if the kernels did not take its shape
    fast.engine.set_guidance(0.5)  # the last layer only: fine
    assert fast.engine.guidance == 0.5 and _guides(fast.model)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.o_proj does not run on the GPU kernels.*"
                                         r"kernels=False"):
        fast.engine.set_guidance(1.0)
    assert not _guides(fast.model) and fast.engine.guidance == 0.0 and fast.engine.sink is None
    o.__class__ = kernel_class
    assert sorted(fast.generate(PROMPTS[:1], params)[0].guidance) == sorted(first[0].guidance)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config,contract", [(DENSE, "nvfp4-linear"), (MOE, "nvfp4-experts")])
@pytest.mark.parametrize("side", [False, True])
def test_gpu_graph_replays_record_the_eager_steps_guidance(config, contract, side, monkeypatch):
    """On a GPU the guided steps are CUDA-graph replays (their guidance buffers copied to pinned host memory
    before the next step overwrites them): the same guidance bytes as the engine decoding eagerly; with the
    record kernels on a side stream (gpu_trace.SIDE_STREAM) too."""
    from fp4rl import gpu_trace
    from fp4rl.sampler import Sampler

    monkeypatch.setattr(gpu_trace, "SIDE_STREAM", side)

    model = tiny(config, contract)
    params = SamplingParams(n=2, max_new_tokens=8, seed=4, guidance=1.0)
    common = dict(kv_cache="bf16", device=DEV, dtype=torch.bfloat16, eos_token_ids=[], kernels=True)
    graphs = Sampler(model, cuda_graphs=True, **common)
    eager = Sampler(tiny(config, contract), cuda_graphs=False, **common)
    a, b = graphs.generate(PROMPTS, params), eager.generate(PROMPTS, params)
    assert graphs.engine.counts["replays"] > 0 and graphs.engine.graph_error is None
    for x, y in zip(a, b):
        assert x.completion_ids == y.completion_ids
        for k in x.guidance:
            for f in ("bits", "block_scale", "amax"):
                same = torch.equal(x.guidance[k][f].view(torch.uint8), y.guidance[k][f].view(torch.uint8))
                assert same, (k, f)


def test_pack_round_trips_every_key_and_field():
    """A forward's guidance in one flat tensor and back (the step's one copy to the host): every field of
    every key, dtypes and shapes kept, float32 views aligned whatever the byte widths before; rows cut."""
    from fp4rl import gpu_trace

    g = torch.Generator().manual_seed(0)
    got = {"a": trace.Guidance(torch.randint(0, 255, (3, 6), generator=g, dtype=torch.uint8),
                               torch.randn(3, 3, generator=g).to(torch.float8_e4m3fn),
                               torch.randn(3, generator=g)),
           "b.down_proj": trace.Guidance(torch.randint(0, 255, (3, 2, 2), generator=g, dtype=torch.uint8),
                                         torch.randn(3, 2, 1, generator=g).to(torch.float8_e4m3fn),
                                         torch.randn(3, 2, generator=g))}
    flat, layout = gpu_trace.pack(got)
    assert flat.dtype == torch.uint8 and flat.ndim == 1
    for rows in (None, 2):
        back = gpu_trace.unpack(flat.clone(), layout, rows)
        assert list(back) == list(got)
        for k, want in got.items():
            for f in ("bits", "block_scale", "amax"):
                w = getattr(want, f) if rows is None else getattr(want, f)[:rows]
                assert torch.equal(getattr(back[k], f).view(torch.uint8), w.view(torch.uint8)), (k, f)
    assert gpu_trace.pack({}) is None

"""TRACE (fp4rl.trace): the compact guidance cache and rollout-guided rounding.

- where the trainer's x is the sampler's x, guided rounding reproduces the sampler's bytes exactly
  (codes, block scales, global scales), for both scale rules;
- where x is perturbed (other kernels, other precision), the guided codes agree with the sampler's
  wherever the sampler's code is a neighbour of the trainer's scaled value: at least as often as
  round-to-nearest does, and every one-step mismatch is removed; the counter says how many
  round-to-nearest codes guidance changes (there is no "after guidance" count: the guided code's low
  bit is the recorded one by construction, but on exact grid hits, where it keeps the grid point and so is
  never further from the sampler's code than round-to-nearest);
- the cache holds K/8 + K/16 + 4 bytes per row; bad shapes are refused."""

import dataclasses
import itertools

import pytest
import torch

from fp4rl import trace
from fp4rl.nvfp4 import dequantize, quantize
from fp4rl.nvfp4.format import unpack_fp4


def _acts(m=64, k=256, seed=0, spread=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if spread:  # per-token magnitudes over 4 decades, a few outliers
        x = x * torch.logspace(-2, 2, m)[:, None]
        x[:, ::37] *= 8
    return x


@pytest.mark.parametrize("rule", ["6", "4/6"])
def test_same_input_gives_the_samplers_bytes(rule):
    x = _acts()
    q = quantize(x, scale_rule=rule, scale_scope="row")
    g = trace.compact(x, q)
    assert g.bits.shape == (64, 32) and g.block_scale.shape == (64, 16) and g.amax.shape == (64,)
    stats = trace.TraceStats()
    qg = trace.guided_quantize(x, g, scale_rule=rule, stats=stats)
    assert torch.equal(qg.data, q.data)
    assert torch.equal(qg.block_scale.view(torch.uint8), q.block_scale.view(torch.uint8))
    assert torch.equal(qg.global_scale, q.global_scale)
    assert (qg.scale_rule, qg.tile, qg.shape, qg.dtype) == (q.scale_rule, q.tile, q.shape, q.dtype)
    assert stats.elements == x.numel() and stats.disagree_rtn == 0


def test_perturbed_input_moves_towards_the_samplers_codes():
    x = _acts(seed=1)
    q = quantize(x, scale_scope="row")  # the sampler's x and codes
    g = trace.compact(x, q)
    # the trainer's x: the same up to BF16-level noise (what other kernels and precisions leave)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)) * x.abs() * 2 ** -7
    xt = x + noise
    rtn = quantize(xt, scale_scope="row")
    stats = trace.TraceStats()
    guided = trace.guided_quantize(xt, g, stats=stats)
    want = unpack_fp4(q.data)
    agree_rtn = (unpack_fp4(rtn.data) == want).float().mean().item()
    agree_guided = (unpack_fp4(guided.data) == want).float().mean().item()
    assert agree_rtn < 0.999 and agree_guided > agree_rtn  # the noise flips codes; guidance undoes it
    # every code the guided rounding still gets wrong is more than one E2M1 step away from the sampler's
    gc, wc = unpack_fp4(guided.data).long(), want.long()
    wrong = gc != wc
    assert (((gc & 7) - (wc & 7)).abs()[wrong] >= 2).all() or ((gc ^ wc) & 8)[wrong].any()
    assert stats.disagree_rtn > 0
    # the decoded activations are the sampler's to within what the remaining flips leave
    err_rtn = (dequantize(rtn) - dequantize(q)).abs().sum()
    err_guided = (dequantize(guided) - dequantize(q)).abs().sum()
    assert err_guided < 0.5 * err_rtn
    m = stats.metrics()
    assert set(m) == {"trace/code_disagree_rtn", "trace/code_disagree_guided", "trace/cache_bytes_per_token"}
    assert m["trace/code_disagree_guided"] < m["trace/code_disagree_rtn"]


def test_guided_disagreement_counts_the_grid_hits_guidance_keeps():
    """trace/code_disagree_guided: the elements whose guided code's low bit is still not the recorded one.
    Guided rounding moves every element off its round-to-nearest code when the bits differ, except one that
    sits exactly on a grid point (both neighbours with the bit are a step away): it keeps that point. Zeros
    are such points; recorded bits flipped under them must be counted, the other elements must not."""
    x = _acts(seed=5)
    zeros = torch.zeros_like(x, dtype=torch.bool)
    zeros[:, 3::16] = True  # one element per block (the block amax and scales stay x's)
    zeros[::2] = False
    x = torch.where(zeros, torch.zeros_like(x), x)
    q = quantize(x, scale_scope="row")
    g = trace.compact(x, q)
    bits = trace._unpack_bits(g.bits).bool()
    flipped = trace._pack_bits((bits ^ zeros).to(torch.uint8))
    g = dataclasses.replace(g, bits=flipped)  # as if the sampler had seen +-0.5 there
    stats = trace.TraceStats()
    guided = trace.guided_quantize(x, g, stats=stats)
    low = (unpack_fp4(guided.data) & 1).bool()
    still = low != (bits ^ zeros)
    assert torch.equal(still, zeros)  # the flipped zeros, and only they, keep a bit other than recorded
    assert stats.disagree_guided == int(zeros.sum()) > 0 and stats.disagree_rtn == int(zeros.sum())
    assert stats.metrics()["trace/code_disagree_guided"] == int(zeros.sum()) / x.numel()


def test_rtn_disagreement_counts_the_codes_guidance_changes():
    """trace/code_disagree_rtn: the elements whose round-to-nearest code (on the rollout's scales) guidance
    replaces. With the trainer's per-block amax equal to the sampler's (rule "6": the same scales), the
    round-to-nearest quantizer of x_t is that code, so the counter equals the codes that differ."""
    x = _acts(seed=3)
    q = quantize(x, scale_scope="row")
    g = trace.compact(x, q)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)) * x.abs() * 2 ** -6
    blocks, xb = (x + noise).view(64, -1, 16), x.view(64, -1, 16)
    amax = xb.abs().amax(-1, keepdim=True)
    keep = xb.abs() == amax  # each block's largest element stays: same block and row amax, same scales
    xt = torch.where(keep, xb, blocks.clamp(-amax, amax)).view(64, -1)
    rtn = quantize(xt, scale_scope="row")
    assert torch.equal(rtn.block_scale.view(torch.uint8), q.block_scale.view(torch.uint8))
    stats = trace.TraceStats()
    guided = trace.guided_quantize(xt, g, stats=stats)
    changed = int((unpack_fp4(guided.data) != unpack_fp4(rtn.data)).sum())
    assert changed > 0 and stats.disagree_rtn == changed and stats.elements == x.numel()
    assert stats.metrics()["trace/code_disagree_rtn"] == changed / x.numel()


def _signed_step(codes):
    """4-bit codes -> signed E2M1 step (-7..7; +-0 are one point)."""
    c = codes.long()
    return torch.where(c >= 8, -(c & 7), c & 7)


def test_guided_code_is_never_further_from_the_samplers_than_round_to_nearest():
    """Scales chosen so that z = x (amax 2688 = 6 * 448, block scale 1). For every trainer z between two grid
    points and a sampler code that is one of them, the guided code is the sampler's; for z on a grid point
    (or clipped to 6) and a sampler code at most one signed E2M1 step from it, the guided code is never
    further (in signed steps) than round-to-nearest's: on a grid point whose bit differs, a guess between the
    two neighbours with the bit would be two steps off where round-to-nearest is one."""
    from fp4rl.nvfp4.format import E2M1_VALUES, round_to_e2m1

    grid = torch.tensor(E2M1_VALUES)
    zs, cs = [], []
    for sign in (1.0, -1.0):
        for i in range(8):
            for z in [grid[i].item()] + ([(grid[i] * 0.3 + grid[i + 1] * 0.7).item(),
                                         (grid[i] * 0.8 + grid[i + 1] * 0.2).item()] if i < 7 else [7.5]):
                if z in E2M1_VALUES or z > 6:  # on a grid point (clipped): it and its two signed neighbours
                    s = int(_signed_step(round_to_e2m1(torch.tensor([sign * z])))[0])
                    near = {s - 1, s, s + 1}
                else:  # the two values around z
                    near = {int(sign) * i, int(sign) * (i + 1)}
                for c in near:
                    if -7 <= c <= 7:
                        zs.append(sign * z)
                        cs.append(c)
    k = (len(zs) + 15) // 16 * 16
    x = torch.zeros(1, k)
    x[0, :len(zs)] = torch.tensor(zs)
    c = torch.zeros(k, dtype=torch.long)
    c[:len(cs)] = torch.tensor(cs)
    g = trace.Guidance(trace._pack_bits((c.abs() & 1).to(torch.uint8).view(1, k)),
                       torch.ones(1, k // 16).to(torch.float8_e4m3fn), torch.tensor([6.0 * 448]))
    guided = _signed_step(unpack_fp4(trace.guided_quantize(x, g).data))[0]
    rtn = _signed_step(round_to_e2m1(x))[0]
    assert ((guided - c).abs() <= (rtn - c).abs()).all(), [
        (x[0, j].item(), c[j].item(), guided[j].item(), rtn[j].item())
        for j in ((guided - c).abs() > (rtn - c).abs()).nonzero()[:, 0][:6].tolist()]
    # off the grid (and below the clip), a sampler code that is one of the two values around z is reproduced
    z = x[0]
    lo = torch.bucketize(z.abs(), grid, right=True) - 1
    around = (z.abs() < 6) & (grid[lo.clamp(max=7)] != z.abs())
    s = torch.sign(z).long()
    inside = around & ((c == s * lo) | (c == s * (lo + 1)))
    assert inside.sum() > 20 and torch.equal(guided[inside], c[inside])


def test_rows_without_guidance_round_to_nearest():
    x = _acts(m=8)
    q = quantize(x, scale_scope="row")
    g = trace.compact(x, q)
    xt = x * 1.01
    valid = torch.tensor([True, False] * 4)
    out = trace.guided_quantize(xt, g, valid)
    rtn = quantize(xt, scale_scope="row")
    assert torch.equal(out.data[~valid], rtn.data[~valid])
    assert torch.equal(out.global_scale[~valid], rtn.global_scale[~valid])
    assert torch.equal(out.block_scale[valid].view(torch.uint8), q.block_scale[valid].view(torch.uint8))


def test_cache_size_and_refusals():
    x = _acts(m=4, k=64)
    g = trace.compact(x, quantize(x, scale_scope="row"))
    assert g.bytes_per_row() == 64 // 8 + 64 // 16 + 4
    with pytest.raises(ValueError, match="do not match"):
        trace.guided_quantize(x[:, :32], trace.compact(x, quantize(x, scale_scope="row")))
    with pytest.raises(ValueError, match="per-row NVFP4 tensor"):
        trace.compact(torch.zeros(2, 32), quantize(torch.zeros(2, 64), scale_scope="row"))


def test_nonfinite_activations_and_bad_valid_are_refused_clearly():
    x = _acts(m=4, k=64)
    g = trace.compact(x, quantize(x, scale_scope="row"))
    bad = x.clone()
    bad[2, 7] = float("inf")
    for valid in (None, torch.zeros(4, dtype=torch.bool)):  # guided rows or none: the same message
        want = (r"of model.layers.0.mlp.down_proj: the trainer's activations hold "
                r"1 NaN/Inf of 256 \(first rows: \[2")
        with pytest.raises(ValueError, match=want) as err:
            trace.guided_quantize(bad, g, valid, name="model.layers.0.mlp.down_proj")
        assert "allow_nonfinite" not in str(err.value) and "learning rate" in str(err.value)
    with pytest.raises(ValueError, match=r"valid has shape \(2, 2\), expected \(4,\)"):
        trace.guided_quantize(x, g, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"valid has shape \(3,\), expected \(4,\)"):
        trace.guided_quantize(x, g, torch.ones(3, dtype=torch.bool))
    # in the trainer's forward the message names the linear
    from rl_fixtures import tiny_model

    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import convert

    model = convert(tiny_model(), PrecisionContract("nvfp4-linear"))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad(), trace.recording(model) as rec:
        model.model(ids)
    guidance = rec.take()
    with torch.no_grad():
        model.model.embed_tokens.weight[6] = float("nan")
    want = r"guided rounding of model.layers.0.self_attn.q_proj: .* hold 32 NaN/Inf"  # token 6's row, K = 32
    with torch.no_grad(), trace.guiding(model, guidance, torch.ones(4, dtype=torch.bool)), \
            pytest.raises(ValueError, match=want):
        model.model(ids)


def test_guided_layers_and_shared_inputs():
    assert list(trace.guided_layers(30, 0.5)) == list(range(15, 30))
    assert list(trace.guided_layers(30)) == list(range(30))  # the default: every layer
    assert list(trace.guided_layers(4, 0.25)) == [3]
    assert trace.input_key("model.layers.3.self_attn.v_proj") == "model.layers.3.self_attn.q_proj"
    assert trace.input_key("model.layers.3.mlp.up_proj") == "model.layers.3.mlp.gate_proj"
    assert trace.input_key("model.layers.3.mlp.down_proj") == "model.layers.3.mlp.down_proj"


def test_shared_inputs_are_guided_and_counted_once(monkeypatch):
    """q/k/v (gate/up) read one input: guiding quantizes it once and hands the same Q(x) to each, so the
    counters hold the distinct guided elements (not 3x / 2x of them) and the logprobs are unchanged."""
    from rl_fixtures import tiny_model

    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import convert

    model = convert(tiny_model(), PrecisionContract("nvfp4-linear"))
    ids = torch.randint(4, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), trace.recording(model) as rec:
        model.model(ids)
    guidance = {k: trace.Guidance(g.bits.view(2, 9, -1), g.block_scale.view(2, 9, -1), g.amax.view(2, 9))
                for k, g in rec.take().items()}
    assert len(guidance) == 3 * 4  # 3 W4A4 layers x (q, o, gate, down): 12 distinct inputs of 21 linears
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 6:] = False  # rows without guidance are rounded to nearest and not counted
    calls = []
    real = trace.guided_quantize
    monkeypatch.setattr(trace, "guided_quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    stats = trace.TraceStats()
    with torch.no_grad(), trace.guiding(model, guidance, valid, stats):
        out = model.model(ids)[0]
    assert len(calls) == len(guidance)
    assert stats.elements == int(valid.sum()) * sum(g.width for g in guidance.values())
    # the same outputs as when every linear quantizes its input itself (no input ever looks the same twice)
    calls.clear()
    count = itertools.count()
    monkeypatch.setattr(trace, "_version", lambda x: next(count))
    unshared = trace.TraceStats()
    with torch.no_grad(), trace.guiding(model, guidance, valid, unshared):
        assert torch.equal(model.model(ids)[0], out)
    assert len(calls) == 21 and unshared.elements > stats.elements


def test_routed_experts_are_guided_per_token_and_slot(monkeypatch):
    """The recipe's W4A4 linears are the routed experts: their gate/up input is recorded per token (the same
    row whichever expert reads it), their down input per token and slot (each slot's expert has its own
    SiLU(gate) * up). Guiding the same forward (routing replayed) with it gives every expert back its own
    rows' codes and scales: the outputs are those of the recorded forward bit for bit, every guided row
    counted once. Guidance of the wrong rows (two tokens swapped) changes them."""
    from rl_fixtures import tiny_model

    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import convert

    model = convert(tiny_model(moe=True), PrecisionContract("nvfp4-experts", bf16_last_fraction=0.0))
    cfg = model.config
    k, h, f = cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    mods = trace.guided_modules(model)
    assert mods and all(".experts." in n for n in mods)  # nothing else is W4A4 under this preset
    assert trace.input_key("model.layers.2.mlp.experts.3.up_proj") == "model.layers.2.mlp.experts.gate_proj"
    assert trace.expert_input("model.layers.2.mlp.experts.3.down_proj") == (
        "model.layers.2.mlp.experts.down_proj", True)
    assert trace.expert_input("model.layers.2.mlp.down_proj") is None
    ids = torch.randint(4, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    recorded = {}
    add_rows = trace.Recording.add_rows
    monkeypatch.setattr(trace.Recording, "add_rows", lambda self, key, lead, index, g: recorded.update(
        {key: recorded.get(key, 0) + index.numel()}) or add_rows(self, key, lead, index, g))
    with torch.no_grad(), trace.recording(model) as rec:
        ref, routing = model.model(ids)
    got = rec.take()
    # each row recorded once: a token's gate/up input by one of its experts (not top_k times, nor again
    # by up_proj), each (token, slot) down input by its expert
    assert recorded == {key: 18 * (k if key.endswith("down_proj") else 1) for key in got}
    layers = cfg.num_hidden_layers
    assert sorted(got) == sorted(f"model.layers.{i}.mlp.experts.{p}" for i in range(layers)
                                 for p in ("gate_proj", "down_proj"))
    guidance = {}
    for key, g in got.items():
        per_slot = key.endswith("down_proj")
        assert tuple(g.amax.shape) == ((18, k) if per_slot else (18,))
        assert g.width == (f if per_slot else h)
        guidance[key] = trace.Guidance(g.bits.view(2, 9, *g.bits.shape[1:]),
                                       g.block_scale.view(2, 9, *g.block_scale.shape[1:]),
                                       g.amax.view(2, 9, *g.amax.shape[1:]))
        assert guidance[key].bytes_per_token(2) == (k if per_slot else 1) * g.bytes_per_row()
    valid = torch.ones(2, 9, dtype=torch.bool)
    stats = trace.TraceStats()
    with torch.no_grad(), trace.guiding(model, guidance, valid, stats):
        out, _ = model.model(ids, routing=routing)
    assert torch.equal(out, ref)
    assert stats.elements == layers * 18 * k * (h + f)  # per expert row: its gate/up input once, its down
    assert stats.disagree_rtn == 0  # the same x: round-to-nearest already has every recorded bit
    order = torch.tensor([1, 0, 2, 3, 4, 5, 6, 7, 8])
    swapped = {key: g.index(slice(None), order) for key, g in guidance.items()}
    with torch.no_grad(), trace.guiding(model, swapped, valid):
        out, _ = model.model(ids, routing=routing)
    assert not torch.equal(out, ref)
    # experts of one layer quantized unalike would leave rows without guidance: refused, naming the fix
    mixed = convert(tiny_model(moe=True), PrecisionContract("nvfp4-w4a16", rules={"*.experts.0.*": "w4a4"}))
    with pytest.raises(ValueError, match="every expert of a layer must quantize .* alike.*precision rules"):
        trace.guided_modules(mixed)
    # an expert linear run outside run_experts cannot know its rows: a clear error, not a silent guess
    expert = model.model.layers[0].mlp.experts[0]
    with (torch.no_grad(), trace.guiding(model, guidance, valid),
          pytest.raises(RuntimeError, match="EXPERT_ROWS")):
        expert(torch.randn(3, h))

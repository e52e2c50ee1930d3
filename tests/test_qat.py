"""NVFP4Linear and convert: forward, both backward modes, saved bytes, caching, conversion."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fp4rl.nvfp4 import dequantize, fake_quantize, quantize
from fp4rl.precision import PrecisionContract
from fp4rl.qat import NVFP4Linear, convert, invalidate, packed_state, track

W4A4 = PrecisionContract("nvfp4-linear")
PACKED_DTYPES = {torch.uint8, torch.float8_e4m3fn, torch.float32}


def make_linear(mode="w4a4", backward="dequantized", n=48, k=64, bias=True, seed=0, **contract):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    c = PrecisionContract("nvfp4-linear", backward=backward, **contract)
    return NVFP4Linear(lin.weight, lin.bias, mode, c), c


def same_bytes(a, b):
    """Two NVFP4Tensors hold identical codes, block scales and global scales."""
    def raw(q, f):
        return getattr(q, f).reshape(-1).view(torch.uint8)

    return all(torch.equal(raw(a, f), raw(b, f)) for f in ("data", "block_scale", "global_scale"))


def leaf(t):
    return t.detach().clone().requires_grad_(True)


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("contract", [{}, dict(weight_tile=(16, 16), act_four_over_six=False,
                                                weight_err="mae")])
def test_forward_equals_linear_of_fake_quantized_operands(mode, contract):
    m, c = make_linear(mode, **contract)
    x = torch.randn(2, 5, 64) * torch.logspace(-3, 2, 5)[:, None]  # rows of very different scales
    x_fq = fake_quantize(x, **c.input_quantize_kwargs()) if mode == "w4a4" else x
    expected = F.linear(x_fq, fake_quantize(m.weight.detach(), **c.weight_quantize_kwargs()), m.bias)
    assert torch.equal(m(x), expected)
    assert not torch.equal(m(x), F.linear(x, m.weight, m.bias))


def test_per_token_scales_do_not_depend_on_the_batch():
    m, _ = make_linear()
    x = torch.randn(6, 64)
    alone = m.quantize_input(x[:1])
    with_big_neighbours = m.quantize_input(torch.cat([x[:1], 1e4 * x[1:]]))
    first = type(alone)(**{**vars(with_big_neighbours), "data": with_big_neighbours.data[:1],
                           "block_scale": with_big_neighbours.block_scale[:1],
                           "global_scale": with_big_neighbours.global_scale[:1]})
    assert same_bytes(alone, first)


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_dequantized_backward_is_autograd_through_the_forward_operands(mode):
    m, c = make_linear(mode)
    x = torch.randn(3, 7, 64, requires_grad=True)
    grad_y = torch.randn(3, 7, 48)
    m(x).backward(grad_y)
    # reference: the forward's operands as leaves, plain autograd through F.linear
    x_op = leaf(fake_quantize(x.detach(), **c.input_quantize_kwargs()) if mode == "w4a4" else x.detach())
    w_op = leaf(fake_quantize(m.weight.detach(), **c.weight_quantize_kwargs()))
    b = leaf(m.bias)
    F.linear(x_op, w_op, b).backward(grad_y)
    torch.testing.assert_close(x.grad, x_op.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m.weight.grad, w_op.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m.bias.grad, b.grad, rtol=1e-6, atol=1e-6)
    # and it is not the high-precision gradient
    if mode == "w4a4":
        assert not torch.allclose(m.weight.grad, grad_y.reshape(-1, 48).t() @ x.detach().reshape(-1, 64))
    assert not torch.allclose(x.grad, grad_y @ m.weight.detach())


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_high_precision_backward_uses_original_w_and_x(mode):
    m, _ = make_linear(mode, backward="high_precision")
    x = torch.randn(3, 7, 64, requires_grad=True)
    grad_y = torch.randn(3, 7, 48)
    m(x).backward(grad_y)
    x_ref, w_ref, b_ref = leaf(x), leaf(m.weight), leaf(m.bias)
    F.linear(x_ref, w_ref, b_ref).backward(grad_y)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m.weight.grad, w_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m.bias.grad, b_ref.grad, rtol=1e-6, atol=1e-6)


def saved_for_backward(fn):
    """Run fn() and return the tensors autograd saved for backward during it."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


@pytest.mark.parametrize("autocast", [False, True])
def test_dequantized_backward_saves_only_packed_operands(autocast):
    m, _ = make_linear("w4a4", n=32, k=64)
    x = torch.randn(2, 8, 64, requires_grad=True)  # M = 16 tokens
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        saved, y = saved_for_backward(lambda: m(x))
    assert {t.dtype for t in saved} <= PACKED_DTYPES
    assert all(t.numel() <= 16 for t in saved if t.dtype == torch.float32)  # global scales only
    nbytes = sum(t.numel() * t.element_size() for t in saved)
    packed = (16 * 64 + 32 * 64) // 2 + (16 * 64 + 32 * 64) // 16 + 4 * 16 + 4  # codes, block, global
    assert nbytes == packed
    assert y.dtype == (torch.bfloat16 if autocast else torch.float32)
    y.float().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.dtype == torch.float32
    assert m.weight.grad.dtype == torch.float32


def test_high_precision_backward_saves_x_and_w_as_they_are():
    m, _ = make_linear("w4a4", backward="high_precision")
    x = torch.randn(4, 64, requires_grad=True)
    saved, _ = saved_for_backward(lambda: m(x))
    assert len(saved) == 2
    assert saved[0].data_ptr() == x.data_ptr() and saved[1].data_ptr() == m.weight.data_ptr()


def test_w4a16_saves_x_and_packed_weight():
    m, _ = make_linear("w4a16", n=32, k=64)
    x = torch.randn(4, 64, requires_grad=True)
    saved, _ = saved_for_backward(lambda: m(x))
    assert [t.dtype for t in saved] == [torch.uint8, torch.float8_e4m3fn, torch.float32, torch.float32]
    assert saved[-1].data_ptr() == x.data_ptr()


def test_autocast_bf16_matches_bf16_fake_quant_reference():
    m, c = make_linear("w4a4")
    x = torch.randn(5, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    x_fq = fake_quantize(x.detach(), **c.input_quantize_kwargs())
    w_fq = dequantize(quantize(m.weight.detach(), **c.weight_quantize_kwargs()), torch.bfloat16)
    expected = F.linear(x_fq.bfloat16(), w_fq, m.bias.detach().bfloat16())
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)
    y.float().sum().backward()
    assert x.grad.dtype == m.weight.grad.dtype == m.bias.grad.dtype == torch.float32


def test_zero_input_gives_bias_and_finite_gradients():
    for backward in ("dequantized", "high_precision"):
        m, _ = make_linear("w4a4", backward=backward)
        x = torch.zeros(3, 64, requires_grad=True)
        y = m(x)
        assert torch.equal(y, m.bias.detach().expand(3, 48))
        y.sum().backward()
        assert torch.isfinite(x.grad).all() and torch.isfinite(m.weight.grad).all()
        assert torch.equal(m.weight.grad, torch.zeros_like(m.weight))


def test_weight_cache_follows_weight_version_and_packed_state():
    m, c = make_linear("w4a4")
    q1 = m.quantized_weight()
    assert m.quantized_weight() is q1
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    q2 = m.quantized_weight()
    assert q2 is not q1
    assert same_bytes(q2, quantize(m.weight.detach(), **c.weight_quantize_kwargs()))
    model = nn.Sequential(m)
    assert packed_state(model) == {"0.weight": q2}
    with torch.no_grad():
        m.weight.copy_(torch.randn_like(m.weight))
    assert m.quantized_weight() is not q2


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_an_evaluation_under_inference_mode_does_not_break_the_next_training_step(mode):
    """A forward under torch.inference_mode() between two optimizer steps (an evaluation) builds the Q(W)
    cache; the next training step saves that packed weight for backward: it must not be an inference
    tensor (autograd refuses those: "Inference tensors cannot be saved for backward")."""
    m, c = make_linear(mode)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randn(4, 64)
    for _ in range(2):
        m(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.inference_mode():
            y_eval = m(x)
        assert not m.quantized_weight().data.is_inference()
    assert same_bytes(m.quantized_weight(), quantize(m.weight.detach(), **c.weight_quantize_kwargs()))
    assert torch.equal(y_eval, m(x).detach())
    with torch.inference_mode():  # a cache made in inference mode elsewhere (the key still matches)
        m._qweight = quantize(m.weight.detach(), **c.weight_quantize_kwargs())
    m(x).sum().backward()  # rebuilt, not saved for backward as an inference tensor


def test_updates_that_keep_the_version_counter_need_invalidate_or_track():
    """A fused AdamW step and a write through .data leave weight._version as it was, so the cached Q(W) would
    stay the old weights' (the forward, its backward and packed_state then use them): invalidate(model)
    after such an update, or track(optimizer, model) once, re-quantizes."""
    m, c = make_linear("w4a16")
    model = nn.Sequential(m)
    x = torch.randn(4, 64)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    m(x).sum().backward()
    q1, version = m.quantized_weight(), m.weight._version
    opt.step()
    if m.weight._version == version:  # the counter did not move (torch 2.13's fused CPU step): stale
        assert m.quantized_weight() is q1
    assert invalidate(model) == 1
    assert same_bytes(m.quantized_weight(), quantize(m.weight.detach(), **c.weight_quantize_kwargs()))
    handle = track(opt, model)
    for _ in range(2):
        m.weight.grad = torch.randn_like(m.weight)
        opt.step()
        assert same_bytes(m.quantized_weight(), quantize(m.weight.detach(), **c.weight_quantize_kwargs()))
    handle.remove()
    before = m.quantized_weight()
    m.weight.data.mul_(2)  # .data writes: no version bump either
    assert m.quantized_weight() is before
    invalidate(model)
    assert same_bytes(m.quantized_weight(), quantize(m.weight.detach(), **c.weight_quantize_kwargs()))
    assert not same_bytes(m.quantized_weight(), before)


def test_quantize_input_is_the_activation_hook():
    class ZeroActivations(NVFP4Linear):
        def quantize_input(self, x):
            return quantize(torch.zeros_like(x), **self.input_kwargs)

    m, c = make_linear("w4a4")
    z = ZeroActivations(m.weight, m.bias, "w4a4", c)
    assert torch.equal(z(torch.randn(3, 64)), m.bias.detach().expand(3, 48))


def tiny_model(model_type="llama", layers=4, **kw):
    """fp4rl's own decoder (HF names, plain nn.Linear everywhere, experts included), random weights."""
    from fp4rl.model import CausalLM, ModelConfig

    if model_type == "qwen2_moe":
        kw = dict(qkv_bias=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=64, **kw)
    torch.manual_seed(0)
    cfg = ModelConfig(model_type=model_type, vocab_size=96, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      **kw)
    return CausalLM(cfg).eval()


def test_convert_keeps_names_and_parameters_and_trains():
    model = tiny_model()
    ids = torch.randint(0, 96, (2, 12))
    before = model(ids)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())

    assert convert(model, PrecisionContract("bf16")) is model
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())
    assert torch.equal(model(ids), before)

    convert(model, W4A4)
    converted = {n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert converted == {n for n, p in W4A4.resolve(model).items() if p == "w4a4"}
    assert len(converted) == 3 * 7  # layers 0-2; layer 3 (last 15%) and lm_head stay BF16
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert set(packed_state(model)) == {f"{n}.weight" for n in converted}
    logits = model(ids)
    assert torch.isfinite(logits).all() and not torch.equal(logits, before)
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert "NVFP4 %" in W4A4.summary(model)  # a converted model still resolves and summarizes

    convert(model, PrecisionContract("bf16"))  # and back
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())
    assert torch.equal(model(ids), before)


def test_convert_refuses_shapes_that_do_not_tile():
    model = tiny_model(layers=1)
    model.model.layers[0].mlp.up_proj = nn.Linear(64, 120, bias=False)
    model.model.layers[0].mlp.down_proj = nn.Linear(120, 64, bias=False)
    c = PrecisionContract("nvfp4-linear", bf16_last_fraction=0)
    with pytest.raises(ValueError, match="down_proj.*in_features must be a multiple of 16"):
        convert(model, c)
    c16 = PrecisionContract("nvfp4-linear", bf16_last_fraction=0, weight_tile=(16, 16),
                            rules=[("*.down_proj", "bf16")])
    with pytest.raises(ValueError, match="up_proj.*out_features too"):
        convert(model, c16)
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())  # all or nothing


def test_memory_bench_packed_operands_under_0_3x_naive_fake_quant():
    from fp4rl.benchmarks.memory import linear_table

    rows = {r["variant"]: r for r in linear_table(features=256, tokens=64)}
    naive = rows["naive fake-quant QAT (STE)"]["held"]
    assert naive == (64 * 256 + 256 * 256) * 2  # BF16 copies of DQ(Q(x)) and DQ(Q(W))
    packed = rows["fp4rl W4A4, backward=dequantized"]["held"]
    assert packed == (64 * 256 + 256 * 256) * 9 // 16 + 4 * 64 + 4
    assert packed <= 0.3 * naive
    assert rows["fp4rl W4A4, backward=high_precision"]["held"] == 64 * 256 * 2  # x only


def test_convert_qwen2_moe_nvfp4_experts_converts_routed_experts_and_trains():
    model = tiny_model("qwen2_moe", layers=7)
    c = PrecisionContract("nvfp4-experts")
    convert(model, c)
    converted = {n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert converted == {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(6) for e in range(4)
                         for p in ("gate_proj", "up_proj", "down_proj")}  # layer 6: the last 15% (1.05 -> 1)
    assert all(m.mode == "w4a4" for n, m in model.named_modules() if n in converted)
    ids = torch.randint(0, 96, (2, 16))
    logits, routing = model(ids, return_routing=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.data.clone() for k, v in packed_state(model).items()}
    F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    expert = model.model.layers[0].mlp.experts[int(routing[0][0, 0, 0])]
    assert isinstance(expert.up_proj, NVFP4Linear) and torch.isfinite(expert.up_proj.weight.grad).all()
    assert expert.up_proj.weight.grad.abs().sum() > 0
    opt.step()
    after = packed_state(model)
    assert set(after) == set(before)
    key = f"model.layers.0.mlp.experts.{int(routing[0][0, 0, 0])}.up_proj.weight"
    assert not torch.equal(after[key].data, before[key])
    replayed = model(ids, routing=routing)  # routing replay runs through the converted experts
    assert torch.isfinite(replayed).all()


def test_fused_groups_share_one_weight_global_scale():
    from fp4rl.nvfp4 import global_scales_from_amax

    model = convert(tiny_model(), W4A4)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    with torch.no_grad():
        attn.k_proj.weight.mul_(10)  # k has the largest amax of q/k/v
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    group_amax = torch.stack([m.weight.detach().abs().amax() for m in qkv]).amax()
    expected = global_scales_from_amax(group_amax, "4/6").global_scale
    for m in qkv:
        q = m.quantized_weight()
        assert torch.equal(q.global_scale, expected.reshape(()))
        assert same_bytes(q, quantize(m.weight.detach(), amax=group_amax, **W4A4.weight_quantize_kwargs()))
    gate, up = mlp.gate_proj.quantized_weight(), mlp.up_proj.quantized_weight()
    assert torch.equal(gate.global_scale, up.global_scale)
    assert attn.o_proj.scale_group == [attn.o_proj] and mlp.down_proj.scale_group == [mlp.down_proj]
    q_before = attn.q_proj.quantized_weight()
    with torch.no_grad():
        attn.k_proj.weight.mul_(2)  # a sibling's change re-quantizes q (its global scale moved)
    assert not torch.equal(attn.q_proj.quantized_weight().global_scale, q_before.global_scale)

    separate = convert(tiny_model(), PrecisionContract("nvfp4-linear", fuse_global_scales=False))
    attn = separate.model.layers[0].self_attn
    assert same_bytes(attn.q_proj.quantized_weight(),
                      quantize(attn.q_proj.weight.detach(), **W4A4.weight_quantize_kwargs()))


def test_quantized_weight_for_another_device_is_the_cached_bytes():
    """quantized_weight(device=) for a sampler on another device than the master weights: a current cache
    is returned as is; without one, the group's weights are quantized where asked, uncached, to the bytes
    the cache holds (fused q/k/v and gate/up with one global scale, experts, plain linears). On a CPU-only
    machine the device is the weights' own; the GPU test in test_packed.py takes the copy to CUDA."""
    from rl_fixtures import tiny_model

    model = convert(tiny_model(moe=True), W4A4)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert any(len(m.scale_group) == 3 for m in linears.values())
    assert any(len(m.scale_group) == 2 for m in linears.values())
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight.mul_(7)  # the group's amax is not q's own
    fresh = {n: m._quantize_group([g.weight for g in m.scale_group], torch.device("cpu"))
             for n, m in linears.items()}
    assert all(m._qweight is None for m in linears.values())  # nothing cached by the uncached path
    for n, m in linears.items():
        cached = m.quantized_weight(device="cpu")
        assert cached is m._qweight and m.quantized_weight(device=torch.device("cpu")) is cached
        assert same_bytes(fresh[n], cached), n
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"layers.0.self_attn.q_proj: its fused group's weights "
                                         r".*non-finite: model.layers.0.self_attn.k_proj"):
        attn.q_proj._quantize_group([g.weight for g in attn.q_proj.scale_group], torch.device("cpu"))


def test_quantized_weight_elsewhere_quantizes_there_uncached(monkeypatch):
    """The branch a CPU-only machine cannot reach with real tensors: a device other than the weights' ('meta'
    stands in for a GPU; _quantize_group recorded) -> the group quantized there, nothing cached, a stale cache
    dropped; a current cache is returned wherever it lives, nothing quantized."""
    from rl_fixtures import tiny_model

    model = convert(tiny_model(), W4A4)
    q_proj = model.model.layers[0].self_attn.q_proj
    cached = q_proj.quantized_weight()
    calls, sentinel = [], object()
    monkeypatch.setattr(NVFP4Linear, "_quantize_group",
                        lambda self, ws, dev: calls.append((ws, dev)) or sentinel)
    assert q_proj.quantized_weight(device="meta") is cached and not calls  # current: returned as is
    with torch.no_grad():
        q_proj.weight.add_(0.01)  # the cache is stale now
    assert q_proj.quantized_weight(device="meta") is sentinel
    (weights, dev), = calls
    assert dev == torch.device("meta")
    assert [w is m.weight for w, m in zip(weights, q_proj.scale_group)] == [True] * 3
    assert q_proj._qweight is None and q_proj._qweight_key is None  # dropped, not replaced
    assert q_proj.quantized_weight() is sentinel and len(calls) == 2  # the weights' own device: cached again
    assert q_proj._qweight is sentinel


def test_non_finite_weights_and_activations_name_the_linear():
    """A NaN reaching a quantized linear (a diverged update, a damaged checkpoint) is named: which linear,
    weight or input activation, and what to do; a fused group names the member that holds it."""
    from rl_fixtures import tiny_model

    model = convert(tiny_model(), PrecisionContract("nvfp4-linear"))
    ids = torch.tensor([[5, 6, 7, 8]])
    model(ids)  # finite: fine
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"NVFP4Linear model.layers.0.mlp.down_proj: its weight holds NaN "
                                         r"or Inf.*lower trainer.lr"):
        model(ids)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[3, 5] = 0.0
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.q_proj: its fused group's weights \(one "
                                         r"global scale; non-finite: model.layers.1.self_attn.k_proj\)"):
        model(ids)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = 0.0
        model.model.layers[1].input_layernorm.weight[2] = float("nan")  # layer 1's q/k/v inputs
    with pytest.raises(ValueError, match=r"NVFP4Linear model.layers.1.self_attn.q_proj: its input "
                                         r"activation holds NaN or Inf"):
        model(ids)

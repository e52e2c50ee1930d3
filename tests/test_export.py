"""NVFP4 export (ModelOpt, compressed-tensors) and import back: bytes, the formats' own libraries as
oracles, the config fields vLLM/SGLang read, export -> import -> identical logits, tampering."""

import argparse
import contextlib
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import fp4rl
from fp4rl.export import add_arguments, export, export_model, run
from fp4rl.export_files import MANIFEST
from fp4rl.export_formats import encode_global_scale, reciprocal
from fp4rl.export_import import _install
from fp4rl.model import CausalLM, ModelConfig
from fp4rl.nvfp4 import E2M1_TABLE, NVFP4Tensor, dequantize, unpack_fp4
from fp4rl.precision import PrecisionContract, is_linear
from fp4rl.qat import NVFP4Linear, convert, packed_state
from fp4rl.sampler import Sampler
from fp4rl.weight_sync import build_payload

pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer files")  # tiny models have none
POW2_CODES = torch.tensor([0, 1, 2, 4, 6, 8, 9, 10, 12, 14])  # |e2m1| in {0, .5, 1, 2, 4}: order-free


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: OpenMP threads only add barrier waits, badly so on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(model_type="llama", layers=4, seed=0):
    """A random fp4rl decoder whose FP32 weights are BF16 values (so a BF16 export is lossless)."""
    kw = {}
    if model_type == "qwen2_moe":
        kw = dict(qkv_bias=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=64)
    if model_type == "qwen3_moe":
        kw = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    torch.manual_seed(seed)
    cfg = ModelConfig(model_type=model_type, vocab_size=96, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      qk_norm=model_type.startswith("qwen3"), **kw)
    model = CausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float() * (1 + 3 * (p.dim() == 2)))  # larger weights: visible NVFP4 error
    return model


IDS = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))


def export_as(model, preset, out, fmt, activations, **kw):
    """export_model, which warns when the activation mode is not the one the model was trained in (tiny
    models have no tokenizer: W4A4 calibrates on random token ids)."""
    kw.setdefault("calib_ids", "random")
    trained = "w4a16" if preset == "nvfp4-w4a16" else "w4a4"
    warns = activations not in (None, trained)
    with pytest.warns(UserWarning, match="another function") if warns else contextlib.nullcontext():
        return export_model(model, PrecisionContract(preset), out, format=fmt, activations=activations, **kw)


def exported(tmp_path_factory, model_type, preset, fmt, activations=None, **kw):
    model = tiny(model_type)
    out = tmp_path_factory.mktemp("export") / "out"
    export_as(model, preset, out, fmt, activations, **kw)
    return model, out, load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())


@pytest.fixture(scope="module")
def dense_modelopt(tmp_path_factory):
    return exported(tmp_path_factory, "llama", "nvfp4-linear", "modelopt")


@pytest.fixture(scope="module")
def dense_ct(tmp_path_factory):
    return exported(tmp_path_factory, "llama", "nvfp4-linear", "compressed-tensors")


def codes_of(q):
    return unpack_fp4(q.data)  # [N, K]


def assert_library_values(lib32, lib16, q_served, name, *, max_ulps, pow2_exact):
    """A format library's dequantization of the exported tensors is fp4rl's dequantization of the
    same bytes: bit-identical in BF16 (what the libraries produce by default), and in FP32 up to
    the order of the operations (fp4rl: (e2m1 * s) * g; ModelOpt: e2m1 * (s * g), identical
    wherever |e2m1| is a power of two; compressed-tensors: e2m1 * (s / G))."""
    ours = dequantize(q_served, torch.float32)
    assert torch.equal(lib16, dequantize(q_served, torch.bfloat16)), name
    if pow2_exact:
        pow2 = torch.isin(codes_of(q_served), POW2_CODES)
        assert torch.equal(lib32[pow2], ours[pow2]), name
    assert bool((torch.sign(lib32) == torch.sign(ours)).all()), name
    ulps = (lib32.view(torch.int32) - ours.view(torch.int32)).abs()
    assert int(ulps.max()) <= max_ulps, name


def served(q, g):
    return NVFP4Tensor(data=q.data, block_scale=q.block_scale, global_scale=g.reshape(()), shape=q.shape,
                       dtype=q.dtype)


def test_modelopt_holds_the_trained_bytes_and_modelopt_dequantizes_them(dense_modelopt):
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    model, _, st, _ = dense_modelopt
    packed = packed_state(model)
    assert len(packed) == 3 * 7
    for key, q in packed.items():
        name = key.removesuffix(".weight")
        w, s, g = st[f"{name}.weight"], st[f"{name}.weight_scale"], st[f"{name}.weight_scale_2"]
        assert torch.equal(w, q.data) and torch.equal(s.view(torch.uint8), q.block_scale.view(torch.uint8))
        assert g.shape == () and g.dtype == torch.float32 and torch.equal(g, q.global_scale), name
        lib = NVFP4QTensor(q.shape, torch.float32, w)
        kw = dict(scale=s, double_scale=g, block_sizes={-1: 16})
        lib32, lib16 = lib.dequantize(torch.float32, **kw), lib.dequantize(torch.bfloat16, **kw)
        assert_library_values(lib32, lib16, q, name, max_ulps=1, pow2_exact=True)
    for layer in range(3):  # fused groups share one global scale
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            part = "self_attn" if group[0] == "q_proj" else "mlp"
            scales = [st[f"model.layers.{layer}.{part}.{n}.weight_scale_2"] for n in group]
            assert all(torch.equal(s, scales[0]) for s in scales)


def test_compressed_tensors_decompressor_reads_back_the_trained_values(dense_ct):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    model, _, st, config = dense_ct
    scheme = QuantizationConfig.model_validate(config["quantization_config"]).config_groups["group_0"]
    exact = 0
    for key, q in packed_state(model).items():
        name = key.removesuffix(".weight")
        packed, s = st[f"{name}.weight_packed"], st[f"{name}.weight_scale"]
        G = st[f"{name}.weight_global_scale"]
        assert torch.equal(packed, q.data)
        assert torch.equal(s.view(torch.uint8), q.block_scale.view(torch.uint8))
        n, k = q.shape
        # nibble order and sign convention, independent of any scale arithmetic
        values = unpack_fp4_from_uint8(packed, n, k, dtype=torch.float32)
        assert torch.equal(values, E2M1_TABLE[codes_of(q).long()])
        assert G.shape == (1,) and G.dtype == torch.float32
        g_served = reciprocal(G[0])  # what vLLM/SGLang compute from the encode-direction scale
        exact += bool(torch.equal(g_served, q.global_scale))
        assert torch.equal(G, encode_global_scale(q.global_scale).reshape(1))
        lib16 = NVFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": s,
                                                  "weight_global_scale": G}, scheme)["weight"]
        lib32 = ct_dequantize(unpack_fp4_from_uint8(packed, n, k, dtype=torch.float32), s.float(),
                              args=scheme.weights, global_scale=G, dtype=torch.float32)  # the same, in FP32
        assert_library_values(lib32, lib16, served(q, g_served), name, max_ulps=2, pow2_exact=False)
    assert exact == json.loads((dense_ct[1] / MANIFEST).read_text())["global_scales"]["exact"]


def test_encode_global_scale_inverts_exactly_whenever_an_fp32_scale_can():
    g = torch.rand(20000, generator=torch.Generator().manual_seed(0)) * 0.02 + 1e-6
    G = encode_global_scale(g)
    exact = reciprocal(G) == g
    near = torch.stack([torch.nextafter(G, torch.full_like(G, d)) for d in (0.0, 1e30)])
    near2 = torch.stack([torch.nextafter(x, torch.full_like(x, d)) for x, d in zip(near, (0.0, 1e30))])
    some_g_exists = exact | (reciprocal(near) == g).any(0) | (reciprocal(near2) == g).any(0)
    assert torch.equal(exact, some_g_exists)
    assert 0.75 < exact.float().mean() < 0.95  # an fp32 reciprocal misses some fp32 values
    ulp = torch.nextafter(g, torch.full_like(g, 1.0)) - g
    assert bool(((reciprocal(G) - g).abs() <= ulp).all())


# vLLM's loaders (vllm/model_executor/layers/quantization/modelopt.py, compressed_tensors/...),
# and SGLang's modelopt_quant.py read these; each must be present with these values.
MODELOPT_REQUIRED = ("quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules")
MODELOPT_LINEAR = {"weight": (torch.uint8, lambda n, k: (n, k // 2)),  # per quantized linear [n, k]
                   "weight_scale": (torch.float8_e4m3fn, lambda n, k: (n, k // 16)),
                   "weight_scale_2": (torch.float32, lambda n, k: ()),
                   "input_scale": (torch.float32, lambda n, k: ())}
CT_LINEAR = {"weight_packed": (torch.uint8, lambda n, k: (n, k // 2)),
             "weight_scale": (torch.float8_e4m3fn, lambda n, k: (n, k // 16)),
             "weight_global_scale": (torch.float32, lambda n, k: (1,)),
             "input_global_scale": (torch.float32, lambda n, k: (1,))}
CT_NVFP4_ARGS = dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True)


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("activations", ["w4a4", "w4a16"])
def test_configs_and_tensors_carry_what_vllm_and_sglang_read(tmp_path_factory, fmt, activations):
    model, out, st, config = exported(tmp_path_factory, "qwen3_moe", "nvfp4-linear", fmt, activations,
                                      calib_prompts=2)
    qc = config["quantization_config"]
    quantized = {k.removesuffix(".weight") for k in packed_state(model)}
    if fmt == "modelopt":
        hf = json.loads((out / "hf_quant_config.json").read_text())
        q = hf["quantization"]
        assert all(key in q for key in MODELOPT_REQUIRED) and hf["producer"]["name"] == "fp4rl"
        assert q["quant_algo"] == {"w4a4": "NVFP4", "w4a16": "W4A16_NVFP4"}[activations]
        assert q["kv_cache_quant_algo"] is None and q["group_size"] == 16
        exclude = q["exclude_modules"]
        assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == q["quant_algo"]
        assert qc["ignore"] == exclude
        from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

        assert {k: qc[k] for k in convert_hf_quant_config_format(hf)} == convert_hf_quant_config_format(hf)
        linear, input_key = MODELOPT_LINEAR, "input_scale"
    else:
        from compressed_tensors.quantization import QuantizationConfig

        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
        (group,) = qc["config_groups"].values()
        assert group["format"] == "nvfp4-pack-quantized" and group["targets"] == ["Linear"]
        assert {k: group["weights"][k] for k in CT_NVFP4_ARGS} == CT_NVFP4_ARGS
        assert group["weights"]["dynamic"] is False
        if activations == "w4a4":
            assert {k: group["input_activations"][k] for k in CT_NVFP4_ARGS} == CT_NVFP4_ARGS
        else:
            assert group["input_activations"] is None
        scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
        assert (scheme.input_activations is None) == (activations == "w4a16")
        exclude = qc["ignore"]
        linear, input_key = CT_LINEAR, "input_global_scale"
    assert config["torch_dtype"] == "bfloat16"
    linears = {n for n, m in model.named_modules() if is_linear(m)}
    assert set(exclude) - linears == {"model.layers.3.mlp.experts"}  # the last layer's fused MoE module
    assert linears - set(exclude) == quantized
    for name in quantized:
        n, k = model.get_submodule(name).weight.shape
        for suffix, (dtype, shape) in linear.items():
            if suffix == input_key and activations == "w4a16":
                assert f"{name}.{suffix}" not in st
                continue
            t = st[f"{name}.{suffix}"]
            assert t.dtype == dtype and tuple(t.shape) == shape(n, k), (name, suffix)
    assert all(st[k].dtype == torch.bfloat16 for k in st if k.rpartition(".")[0] in exclude)
    readme = (out / "README.md").read_text()
    assert "vllm serve" in readme
    no_sglang = (fmt, activations) == ("modelopt", "w4a16")  # SGLang's ModelOpt loader: FP8/NVFP4 only
    assert ("--format compressed-tensors" if no_sglang else "sglang.launch_server") in readme


def test_w4a4_input_scales_are_the_calibration_amax(tmp_path):
    model = convert(tiny(), PrecisionContract("nvfp4-linear"))  # calibration runs the NVFP4 model
    calib = [IDS[0].tolist(), IDS[1, :7].tolist()]
    norms = {}
    hooks = [model.get_submodule(f"model.layers.{i}.{n}").register_forward_hook(
        lambda m, a, y, key=(i, n): norms.__setitem__(key, max(norms.get(key, 0.0), y.abs().amax().item())))
        for i in range(3) for n in ("input_layernorm", "post_attention_layernorm")]
    with torch.no_grad():
        for ids in calib:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    for fmt in ("modelopt", "compressed-tensors"):
        export_model(model, PrecisionContract("nvfp4-linear"), tmp_path / fmt, format=fmt, calib_ids=calib)
        st = load_file(tmp_path / fmt / "model.safetensors")
        for (i, norm), amax in norms.items():
            expected = torch.tensor(amax, dtype=torch.float32) / torch.tensor(2688.0)
            names = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
                     if norm == "input_layernorm" else ("mlp.gate_proj", "mlp.up_proj"))
            for n in names:
                key = f"model.layers.{i}.{n}"
                if fmt == "modelopt":
                    assert torch.equal(st[f"{key}.input_scale"], expected), key
                else:
                    G = st[f"{key}.input_global_scale"]
                    assert torch.equal(G, encode_global_scale(expected).reshape(1)), key
    manifest = json.loads((tmp_path / "modelopt" / MANIFEST).read_text())
    assert manifest["calibration"]["tokens"] == 18


CASES = [  # (model, preset, format, activations)
    ("llama", "nvfp4-linear", "modelopt", None),
    ("llama", "nvfp4-w4a16", "compressed-tensors", None),
    ("qwen2_moe", "nvfp4-experts", "modelopt", None),
    ("qwen2_moe", "nvfp4-experts", "compressed-tensors", "w4a16"),
    ("qwen3_moe", "nvfp4-linear", "compressed-tensors", None),
    ("qwen3_moe", "nvfp4-experts", "modelopt", "w4a16"),
]


@pytest.mark.parametrize("model_type,preset,fmt,activations", CASES)
def test_export_import_gives_the_served_model(tmp_path, model_type, preset, fmt, activations):
    model = tiny(model_type)
    contract = PrecisionContract(preset)
    out = export_as(model, preset, tmp_path / "out", fmt, activations, calib_prompts=3)
    packed = packed_state(model)
    served_g = {k: (q.global_scale if fmt == "modelopt" else reciprocal(encode_global_scale(q.global_scale)))
                for k, q in packed.items()}
    if activations:  # the reference serves the same bytes with the exported activation mode
        for m in model.modules():
            if isinstance(m, NVFP4Linear):
                m.mode = activations
    for k, q in packed.items():  # the reference computes with the global scales a server recovers
        _install(model.get_submodule(k.removesuffix(".weight")), served(q, served_g[k]))
    with torch.no_grad():
        expected = model(IDS)

    loaded, tokenizer = fp4rl.load_model(out)
    assert tokenizer is None
    with torch.no_grad():
        assert torch.equal(loaded(IDS), expected)
    again = packed_state(loaded)
    assert set(again) == set(packed)
    for k, q in again.items():
        assert torch.equal(q.data, packed[k].data) and torch.equal(q.global_scale, served_g[k])
        assert (q.tile, q.scale_rule) == (packed[k].tile, packed[k].scale_rule)  # what weight sync compares
        assert torch.equal(q.block_scale.view(torch.uint8), packed[k].block_scale.view(torch.uint8))
        assert torch.equal(loaded.get_submodule(k.removesuffix(".weight")).weight, dequantize(q))  # master=DQ
    want = {n: (activations or p) if p != "bf16" else p for n, p in contract.resolve(model).items()}
    recovered = loaded.precision_contract
    assert recovered.resolve(loaded) == want
    assert recovered.preset == preset or (activations and recovered.preset in (preset, "nvfp4-w4a16"))

    sampler = Sampler(loaded, eos_token_ids=[])  # a rollout engine on the loaded bytes
    loaded.train()  # continuing RL: gradients flow, and a step re-quantizes the new master weights
    params = [p for p in loaded.parameters() if p.requires_grad]
    loaded(IDS).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
    torch.optim.SGD(params, lr=1e-2).step()
    k0, q0 = next(iter(again.items()))
    assert packed_state(loaded)[k0] is not q0
    sampler.load(build_payload(loaded, recovered, version=1), verify=True)  # the first sync is accepted
    assert sampler.policy_version == 1


def test_moe_experts_are_written_one_by_one(tmp_path):
    model = tiny("qwen2_moe", layers=3)
    export_model(model, PrecisionContract("nvfp4-experts"), tmp_path / "out", calib_prompts=4,
                 calib_ids="random")
    st = load_file(tmp_path / "out" / "model.safetensors")
    hf_quant = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())
    exclude = hf_quant["quantization"]["exclude_modules"]
    for layer in (0, 1):
        inputs = []
        for e in range(4):
            key = f"model.layers.{layer}.mlp.experts.{e}"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert st[f"{key}.{proj}.weight"].dtype == torch.uint8
            assert torch.equal(st[f"{key}.gate_proj.weight_scale_2"], st[f"{key}.up_proj.weight_scale_2"])
            assert torch.equal(st[f"{key}.gate_proj.input_scale"], st[f"{key}.up_proj.input_scale"])
            inputs.append(st[f"{key}.gate_proj.input_scale"])
        assert all(torch.equal(x, inputs[0]) for x in inputs)  # one MoE input scale per layer
        for kept in ("mlp.gate", "mlp.shared_expert.gate_proj", "mlp.shared_expert_gate", "self_attn.q_proj"):
            assert f"model.layers.{layer}.{kept}" in exclude
    assert "model.layers.2.mlp.experts" in exclude and "lm_head" in exclude
    assert st["model.layers.2.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_file_changed_after_export_is_refused_naming_it(tmp_path, dense_modelopt):
    out = dense_modelopt[1]
    fp4rl.load_model(_copy(out, tmp_path / "ok"))

    d = _copy(out, tmp_path / "truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(ValueError, match=r"model\.safetensors is \d+ bytes.*truncated"):
        fp4rl.load_model(d)

    d = _copy(out, tmp_path / "flipped")
    st = load_file(d / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    st[key] = st[key].clone()
    st[key][0, 0] ^= 0x11
    save_file(st, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors .*(sha256|bytes)"):
        fp4rl.load_model(d)

    d = _copy(out, tmp_path / "config")
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"]["ignore"] = config["quantization_config"]["ignore"][1:]
    (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    with pytest.raises(ValueError, match=r"config\.json .*(sha256|bytes)"):
        fp4rl.load_model(d)

    d = _copy(out, tmp_path / "added")
    shutil.copyfile(d / "model.safetensors", d / "model-extra.safetensors")
    with pytest.raises(ValueError, match=r"model-extra\.safetensors is not in fp4rl_manifest\.json"):
        fp4rl.load_model(d)

    d = _copy(out, tmp_path / "missing")
    (d / "hf_quant_config.json").unlink()
    with pytest.raises(ValueError, match=r"hf_quant_config\.json is listed .* but missing"):
        fp4rl.load_model(d)

    d = _copy(out, tmp_path / "two_scales")  # another producer's (no manifest) with two global scales
    (d / MANIFEST).unlink()
    st = load_file(d / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.weight_scale_2"
    st[key] = st[key].reshape(1).repeat(2)
    save_file(st, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weight_scale_2 holds 2 values \[2\].*one global scale per"):
        fp4rl.load_model(d)


def test_export_is_on_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """OUT is complete or absent, also after a power loss: every file and the temporary folder are
    fsynced before the rename publishes them, and the parent folder after it."""
    events, real_fsync, real_rename = [], os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", os.path.realpath(src), os.path.realpath(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    out = export_model(tiny(layers=2), PrecisionContract("nvfp4-w4a16"), tmp_path / "out")
    i, tmp = next((i, e[1]) for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(out.resolve()))
    synced = {e[1] for e in events[:i] if e[0] == "fsync"}
    assert {os.path.join(tmp, p.name) for p in out.iterdir()} | {tmp} <= synced
    assert ("fsync", os.path.realpath(tmp_path)) in events[i + 1:]


def test_refuses_what_a_server_would_run_differently(tmp_path):
    def attempt(model, contract, **kw):
        export_model(model, contract, tmp_path / "x", calib_ids="random", **kw)

    with pytest.raises(ValueError, match="q_proj.*k_proj.*v_proj.*one fused GEMM"):
        attempt(tiny(), PrecisionContract("nvfp4-linear", rules=(("*.q_proj", "bf16"),)))
    model = tiny()
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(0.5)  # its own amax, so its own scale
    with pytest.raises(ValueError, match="different weight global scales.*fuse_global_scales=True"):
        attempt(model, PrecisionContract("nvfp4-linear", fuse_global_scales=False))
    with pytest.raises(ValueError, match="routed experts of model.layers.0.mlp mix"):
        one_expert_bf16 = (("*.0.mlp.experts.1.*", "bf16"),)
        attempt(tiny("qwen3_moe"), PrecisionContract("nvfp4-experts", rules=one_expert_bf16))
    with pytest.raises(ValueError, match="quantizes no linear"):
        attempt(tiny(), PrecisionContract("bf16"))
    mixed = PrecisionContract("nvfp4-linear", rules=(("model.layers.0.*", "w4a16"),))
    with pytest.raises(ValueError, match="mixes.*activations="):
        attempt(tiny(), mixed)
    assert not (tmp_path / "x").exists()  # nothing half-written
    with pytest.warns(UserWarning, match=r"trained \['w4a16', 'w4a4'\] are exported w4a16"):
        attempt(tiny(), mixed, activations="w4a16")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        attempt(tiny(), PrecisionContract("nvfp4-linear"))
    attempt(tiny(), PrecisionContract("nvfp4-linear"), overwrite=True)
    assert json.loads((tmp_path / "x" / MANIFEST).read_text())["activations"] == "w4a4"


def test_force_replaces_only_an_earlier_export_or_an_empty_folder(tmp_path):
    def attempt(out, overwrite=True):
        return export_model(tiny(layers=2), PrecisionContract("nvfp4-w4a16"), out, overwrite=overwrite)

    mine = tmp_path / "mine"  # not an export: --force must not delete it
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for overwrite in (True, False):
        with pytest.raises(FileExistsError, match=r"not an fp4rl export \(no fp4rl_manifest.json.*notes.txt.*"
                                                  "pick another OUT"):
            attempt(mine, overwrite)
    assert (mine / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        attempt(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    attempt(tmp_path / "empty", overwrite=False)  # an empty folder, then the export it holds
    with pytest.raises(FileExistsError, match="earlier export; pass overwrite=True"):
        attempt(tmp_path / "empty", overwrite=False)
    attempt(tmp_path / "empty")
    assert (tmp_path / "empty" / MANIFEST).is_file()


def test_cli_exports_a_run_checkpoint_with_its_contract_and_tokenizer(tmp_path, monkeypatch):
    from rl_fixtures import tiny_model, tiny_tokenizer

    from fp4rl.config import dump_toml, load_config
    from fp4rl.hf import save_model

    base = tmp_path / "base"  # the run's model.name: tokenizer and generation config live there
    save_model(tiny_model(moe=True), tiny_tokenizer(), base)
    (base / "generation_config.json").write_text('{"eos_token_id": 2}\n')
    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "step_000003"
    save_model(tiny_model(moe=True, seed=1), None, ckpt)
    cfg = load_config(None, [f"model.name={json.dumps(str(base))}", "precision.preset=nvfp4-experts",
                             "precision.weight_four_over_six=false"])
    (ckpt / "config.toml").write_text(dump_toml(cfg))
    torch.save({}, ckpt / "trainer.pt")

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "served"
    assert run(parser.parse_args([str(tmp_path / "runs" / "r"), str(out), "--format", "compressed-tensors",
                                  "--calib-prompts", "2"])) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["precision"]["preset"] == "nvfp4-experts"
    assert manifest["precision"]["weight_four_over_six"] is False
    assert manifest["calibration"]["source"] == "built-in prompts"
    assert {"tokenizer.json", "generation_config.json", "README.md"} <= {p.name for p in out.iterdir()}
    model, tokenizer = fp4rl.load_model(out)
    assert tokenizer is not None and model.precision_contract.preset == "nvfp4-experts"
    assert model.precision_contract.weight_four_over_six is False

    with pytest.raises(ValueError, match="--precision"):
        export(base, tmp_path / "nope")
    export(base, tmp_path / "from_model", precision="nvfp4-experts", calib_prompts=1)
    assert (tmp_path / "from_model" / "tokenizer.json").is_file()
    for out in (tmp_path / "runs" / "r", tmp_path / "runs", ckpt):  # --force would delete the source
        with pytest.raises(ValueError, match="is the source .* or a folder holding it"):
            export(tmp_path / "runs" / "r", out, overwrite=True)
    assert (ckpt / "trainer.pt").is_file()
    for out, tok in ((base, None), (tmp_path / "served", tmp_path / "served")):  # nor the tokenizer's
        with pytest.raises(ValueError, match="is the tokenizer source .* or a folder holding it"):
            export(tmp_path / "runs" / "r", out, tokenizer=tok, overwrite=True)
    assert (base / "config.json").is_file() and (tmp_path / "served" / "tokenizer.json").is_file()

    # a run of a Hub id (in the local Hugging Face cache): the tokenizer comes from its cached folder
    from fp4rl import hf

    real = hf._resolve
    monkeypatch.setattr(hf, "_resolve", lambda name: base if name == "org/tiny" else real(name))
    cfg = load_config(None, ["model.name=\"org/tiny\"", "precision.preset=nvfp4-experts"])
    (ckpt / "config.toml").write_text(dump_toml(cfg))
    export(tmp_path / "runs" / "r", tmp_path / "from_hub_id", calib_prompts=1)
    assert (tmp_path / "from_hub_id" / "tokenizer.json").is_file()


def test_an_export_without_a_tokenizer_is_refused_unless_asked_for(tmp_path):
    """A run whose model.name is not on this machine exported without a tokenizer (vLLM then cannot serve
    OUT) and calibrated W4A4 on random token ids, silently; now either is an explicit choice."""
    from rl_fixtures import tiny_model

    from fp4rl.config import dump_toml, load_config
    from fp4rl.hf import save_model

    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "step_000003"
    save_model(tiny_model(moe=True, seed=1), None, ckpt)
    cfg = load_config(None, ['model.name="someorg/not-cached-model"', "precision.preset=nvfp4-experts"])
    (ckpt / "config.toml").write_text(dump_toml(cfg))
    torch.save({}, ckpt / "trainer.pt")
    run_dir, out = tmp_path / "runs" / "r", tmp_path / "out"
    with pytest.raises(ValueError, match=r"no tokenizer for .*model.name 'someorg/not-cached-model' .*not on "
                                         r"this machine.*--tokenizer DIR.*--no-tokenizer"):
        export(run_dir, out, calib_prompts=2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty has no tokenizer files .*--tokenizer DIR"):
        export(run_dir, out, tokenizer=tmp_path / "empty")
    save_model(tiny_model(), None, tmp_path / "model")  # a model folder without a tokenizer
    with pytest.raises(ValueError, match="no tokenizer for .*model: .*model has no tokenizer files"):
        export(tmp_path / "model", out, precision="nvfp4-linear")
    with pytest.raises(ValueError, match="not both"):
        export(run_dir, out, tokenizer=tmp_path / "empty", no_tokenizer=True)
    with pytest.raises(ValueError, match="W4A4 input scales .*need a tokenizer.*calib_ids='random'"):
        export_model(tiny(), PrecisionContract("nvfp4-linear"), out)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))  # refused before anything was written

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([str(run_dir), str(out), "--tokenizer", "x", "--no-tokenizer"])
    assert run(parser.parse_args([str(run_dir), str(out), "--no-tokenizer", "--calib-prompts", "2"])) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["calibration"]["source"].startswith("random token ids") and "--no-tokenizer" in \
        manifest["calibration"]["source"]
    assert not any(p.name.startswith("tokenizer") for p in out.iterdir())


@pytest.mark.filterwarnings("ignore:.*has no fp4rl_manifest.json")
def test_importing_fused_groups_with_different_global_scales_warns(tmp_path):
    """Another producer's checkpoint whose q/k/v or gate/up hold different global scales: vLLM serves the
    group with one scale, fp4rl's import computes each linear with its own; the import says so."""
    out = export_as(tiny("qwen3_moe"), "nvfp4-w4a16", tmp_path / "out", "modelopt", None)
    (out / MANIFEST).unlink()  # another producer's: no integrity check
    with pytest.warns(UserWarning) as record:
        fp4rl.load_model(out)
    assert not [w for w in record if "global scales" in str(w.message)]  # fp4rl's own: fused scales
    st = load_file(out / "model.safetensors")
    k, up = "model.layers.0.self_attn.k_proj", "model.layers.1.mlp.experts.1.up_proj"
    for name in (k, up):
        st[f"{name}.weight_scale_2"] = st[f"{name}.weight_scale_2"] * 2
    save_file(st, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"2 fused group\(s\) hold different weight global scales, e.g. "
                      r"model.layers.0.self_attn.q_proj, .*k_proj, .*v_proj: .*vLLM runs each group as one "
                      r"GEMM with one global scale.*computes each linear with its own scale"):
        loaded, _ = fp4rl.load_model(out)
    got = packed_state(loaded)[f"{k}.weight"].global_scale
    assert torch.equal(got, st[f"{k}.weight_scale_2"].reshape(()))  # k_proj keeps its own scale


def test_import_dequantizes_each_linear_straight_into_the_model_dtype(tmp_path, monkeypatch):
    """No float32 copy of every quantized linear (4 bytes a parameter) before the model is built: each
    DQ(packed) is computed in the model's dtype, and holds the values float32-then-cast gave."""
    from fp4rl import export_import

    out = export_as(tiny("qwen3_moe"), "nvfp4-w4a16", tmp_path / "out", "compressed-tensors", None)
    asked, real = [], export_import.dequantize

    def recording(q, dtype=torch.float32):
        asked.append(dtype)
        return real(q, dtype)

    monkeypatch.setattr(export_import, "dequantize", recording)
    loaded, _ = fp4rl.load_model(out, dtype=torch.bfloat16)
    assert asked and set(asked) == {torch.bfloat16}
    for k, q in packed_state(loaded).items():
        master = loaded.get_submodule(k.removesuffix(".weight")).weight
        assert master.dtype == torch.bfloat16 and torch.equal(master, real(q, torch.float32).bfloat16()), k


def test_sharded_export_and_a_checkpoint_without_manifest(tmp_path):
    model = tiny("qwen3_moe")
    out = export_model(model, PrecisionContract("nvfp4-linear"), tmp_path / "out",
                       format="compressed-tensors", max_shard_bytes=30_000, calib_prompts=1,
                       calib_ids="random")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    assert set(shards) <= set(json.loads((out / MANIFEST).read_text())["files"])
    with torch.no_grad():
        expected = model(IDS)
    (out / MANIFEST).unlink()  # as a checkpoint from another producer: no integrity check, no contract
    with pytest.warns(UserWarning, match="no fp4rl_manifest.json"):
        loaded, _ = fp4rl.load_model(out)
    with torch.no_grad():
        got = loaded(IDS)
    exact = all(torch.equal(reciprocal(encode_global_scale(q.global_scale)), q.global_scale)
                for q in packed_state(model).values())
    assert torch.equal(got, expected) if exact else torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    recovered = loaded.precision_contract  # from the files alone: 3 of 4 layers NVFP4
    assert (recovered.preset, recovered.bf16_last_fraction, recovered.rules) == ("nvfp4-linear", 0.25, ())


def test_generate_samples_an_export_with_its_own_precision(tmp_path, monkeypatch, capsys):
    """`fp4rl generate --model OUT` keeps an export's NVFP4 linears (the default --precision bf16 converted
    them back to plain linears: a W4A4 export was sampled without its activation quantizer)."""
    from rl_fixtures import tiny_model, tiny_tokenizer

    from fp4rl import sampler as sampler_module
    from fp4rl.cli import main

    out = export_model(tiny_model(), PrecisionContract("nvfp4-linear"), tmp_path / "out",
                       tokenizer=tiny_tokenizer(), calib_prompts=1)
    seen = []
    real = sampler_module.Sampler

    def recording(model, *args, **kwargs):
        seen.append(sorted({m.mode for m in model.modules() if isinstance(m, NVFP4Linear)}))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(sampler_module, "Sampler", recording)
    argv = ["generate", "--model", str(out), "--prompt", "1 + 1", "--greedy", "--max-new-tokens", "3",
            "--raw"]
    assert main(argv) == 0 and seen == [["w4a4"]]
    with pytest.raises(SystemExit, match="NVFP4 export .*leave it out"):
        main(argv + ["--precision", "nvfp4-w4a16"])
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    assert "no such model directory" in capsys.readouterr().err

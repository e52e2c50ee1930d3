"""NVFP4 export (ModelOpt, compressed-tensors) and import back: bytes, the formats' own libraries as
oracles, the config fields vLLM/SGLang read, export -> import -> identical logits. On disk and the CLI
(tampering, atomic rename, --force, tokenizers): tests/test_export_files.py."""

import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file

import fp4rl
from fp4rl.export import export_model
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
    fused = set()  # ModelOpt: the fused GEMMs' names too where every member is BF16 (SGLang checks those)
    if fmt == "modelopt":
        fused = {"model.layers.3.self_attn.qkv_proj"}
    assert set(exclude) - linears == {"model.layers.3.mlp.experts"} | fused  # the last layer's fused MoE
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
        inputs, downs = [], []
        for e in range(4):
            key = f"model.layers.{layer}.mlp.experts.{e}"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert st[f"{key}.{proj}.weight"].dtype == torch.uint8
            assert torch.equal(st[f"{key}.gate_proj.weight_scale_2"], st[f"{key}.up_proj.weight_scale_2"])
            assert torch.equal(st[f"{key}.gate_proj.input_scale"], st[f"{key}.up_proj.input_scale"])
            inputs.append(st[f"{key}.gate_proj.input_scale"])
            downs.append(st[f"{key}.down_proj.input_scale"])
        assert all(torch.equal(x, inputs[0]) for x in inputs)  # one MoE input scale per layer
        # and one for the experts' down_proj, the largest of theirs: an expert a calibration token or two
        # reached must not clip what the others see
        assert all(torch.equal(x, downs[0]) for x in downs)
        for kept in ("mlp.gate", "mlp.shared_expert.gate_proj", "mlp.shared_expert_gate", "self_attn.q_proj",
                     "self_attn.qkv_proj", "mlp.shared_expert.gate_up_proj"):
            assert f"model.layers.{layer}.{kept}" in exclude
    # SGLang's ModelOpt rule (modelopt_quant.ModelOptFp4Config.get_quant_method: the fused module's own name
    # in the list, or a fullmatch of one of its patterns) finds every BF16 fused GEMM
    import fnmatch
    import re

    def sglang_skips(prefix):
        return prefix in exclude or any(re.fullmatch(fnmatch.translate(p), prefix) for p in exclude)

    for layer in (0, 1, 2):
        assert sglang_skips(f"model.layers.{layer}.self_attn.qkv_proj")
        assert not sglang_skips(f"model.layers.{layer}.mlp.experts.0.gate_up_proj") or layer == 2
    assert "model.layers.2.mlp.experts" in exclude and "lm_head" in exclude
    assert st["model.layers.2.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_an_all_zero_weight_exports_finite_scales_and_loads_back(tmp_path, fmt):
    """A linear whose weights are all 0 (a zero-initialised projection): global scale 1, not 0 (ModelOpt) or
    1/0 (compressed-tensors); its block scales and codes are 0, so it decodes to zeros; fp4rl imports it."""
    model = tiny("llama")
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
    export_model(model, PrecisionContract("nvfp4-w4a16"), tmp_path / "out", format=fmt)
    st = load_file(tmp_path / "out" / "model.safetensors")
    scale = "weight_scale_2" if fmt == "modelopt" else "weight_global_scale"
    key = f"model.layers.0.self_attn.o_proj.{scale}"
    assert st[key].float().reshape(()).item() == 1.0
    loaded, _ = fp4rl.load_model(tmp_path / "out")
    w = dequantize(packed_state(loaded)["model.layers.0.self_attn.o_proj.weight"])
    assert not w.any()


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_an_nvfp4_lm_head_is_refused(tmp_path, fmt):
    """Servers load lm_head as their BF16 vocabulary-parallel head: an NVFP4 one would not be served."""
    model = tiny("llama")
    assert not model.config.tie_word_embeddings
    with pytest.raises(ValueError, match="lm_head is NVFP4 .* Keep lm_head BF16"):
        export_model(model, PrecisionContract("nvfp4-w4a16", rules=(("lm_head", "w4a16"),)), tmp_path / "out",
                     format=fmt)
    assert not (tmp_path / "out").exists()  # refused before anything is written

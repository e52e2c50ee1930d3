"""Read an NVFP4 checkpoint (ModelOpt or compressed-tensors) back into fp4rl.

`load_exported(path)` -> (model, tokenizer, contract): the model's quantized linears are
NVFP4Linears whose quantized weight is exactly the checkpoint's bytes (codes, block scales,
and the decode global scale a server uses: weight_scale_2 for ModelOpt, fp32(1/G) for
compressed-tensors), and whose master weight is their dequantization DQ(packed). So the model
holds the weights the server serves: for W4A16 it computes the function the server serves (up to
GEMM order); for W4A4 only up to the activation scales, since the server quantizes each input with
the static per-tensor input scale calibrated at export while fp4rl quantizes activations per token.
Continuing RL starts from these weights: the first optimizer step changes the master weight and
the next forward quantizes it again.
Moving the model to another device after loading also re-quantizes from the master weight;
load it on the device it will run on (`device=`).

`fp4rl.load_model(path)` dispatches here when the directory is such a checkpoint and returns
the first two; the contract is also set as `model.precision_contract`.

Integrity: an fp4rl export carries fp4rl_manifest.json with the size and sha256 of every file;
a file that is missing, truncated, altered or added (safetensors and JSON configs) is refused
before anything is read, naming the file. A checkpoint from another producer has no manifest
and is read with a warning; so is one whose fused groups (q/k/v, gate/up) hold different weight
global scales, which servers run with one scale per group while fp4rl keeps each linear's own.

The precision contract comes from the manifest when the checkpoint is fp4rl's own and it
resolves to exactly the quantized linears on disk in the exported activation mode. Otherwise
it is recovered from the files: the preset whose resolution matches (with the trailing layers
that hold no NVFP4 linear as the BF16 last layers), else explicit per-module rules.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path

import torch

from fp4rl.export import fused_groups
from fp4rl.export_files import MANIFEST, verify_manifest
from fp4rl.export_formats import FORMAT_CLASSES, HF_QUANT_CONFIG, detect, excluded
from fp4rl.nvfp4 import NVFP4Tensor, dequantize
from fp4rl.precision import PrecisionContract, is_linear, layer_index, module_kind
from fp4rl.qat import NVFP4Linear, convert


def is_exported(path: str | os.PathLike) -> bool:
    """Whether `path` is a ModelOpt or compressed-tensors checkpoint directory."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return False
    from fp4rl.hf import read_json_object  # (hf imports this module inside load_model)

    config = read_json_object(path / "config.json")
    return detect(config, (path / HF_QUANT_CONFIG).is_file()) is not None


def load_exported(path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                  device: torch.device | str = "cpu"):
    """-> (CausalLM with NVFP4Linears holding the checkpoint's bytes, tokenizer or None, contract)."""
    from fp4rl.hf import _pick_dtype, load_state_dict, load_tokenizer
    from fp4rl.model import ModelConfig, build_model

    path = Path(path)
    manifest = None
    if (path / MANIFEST).is_file():
        manifest = verify_manifest(path)
    else:
        warnings.warn(f"{path} has no {MANIFEST} (not written by fp4rl export): its files are read "
                      "without an integrity check", stacklevel=2)
    config = json.loads((path / "config.json").read_text())
    hf_quant = None
    if (path / HF_QUANT_CONFIG).is_file():
        hf_quant = json.loads((path / HF_QUANT_CONFIG).read_text())
    fmt_name = detect(config, hf_quant is not None)
    if fmt_name is None:
        raise ValueError(f"{path} is not an NVFP4 ModelOpt or compressed-tensors checkpoint")
    fmt = FORMAT_CLASSES[fmt_name]
    activations, exclude = fmt.read_settings(config, hf_quant)
    model_config = ModelConfig.from_hf({k: v for k, v in config.items() if k != "quantization_config"})
    dtype = _pick_dtype(dtype, model_config, device)

    tensors = load_state_dict(path)
    kv_scales = [k for k in tensors if k.endswith((".k_scale", ".v_scale"))]
    if kv_scales:
        warnings.warn(f"{path}: ignoring {len(kv_scales)} FP8 KV-cache scales (e.g. {kv_scales[0]}); fp4rl "
                      "chooses its KV cache format itself", stacklevel=2)
        for k in kv_scales:
            del tensors[k]
    packed = {}
    for name in fmt.quantized_names(tensors):
        if excluded(name, exclude):
            raise ValueError(f"{path}: {name} holds NVFP4 weights but the exclude list names it BF16; "
                             "a server would load it wrongly")
        data, block_scale, g = fmt.pop_linear(tensors, name)
        n, k = data.shape[0], data.shape[1] * 2
        if data.dtype != torch.uint8 or block_scale.dtype != torch.float8_e4m3fn \
                or tuple(block_scale.shape) != (n, k // 16):
            raise ValueError(f"{path}: {name} has packed weight {data.dtype} {list(data.shape)} and block "
                             f"scale {block_scale.dtype} {list(block_scale.shape)}; NVFP4 needs uint8 "
                             "[N, K/2] and float8_e4m3fn [N, K/16]")
        _check_scales(path, name, block_scale, g)
        data, block_scale, g = data.to(device), block_scale.to(device), g.to(device)
        packed[name] = (data, block_scale, g)
        # DQ(packed), one tensor at a time, in the model's dtype on its device (float32 math, then the
        # cast: the same values as float32 first), so no float32 copy of every linear is ever held
        tensors[f"{name}.weight"] = dequantize(_nvfp4(data, block_scale, g, dtype), dtype)

    model = build_model(model_config, tensors, dtype=dtype, device=device)
    contract = _contract(model, set(packed), activations, manifest)
    convert(model, contract)
    modules = dict(model.named_modules())
    rule = contract.weight_quantize_kwargs()  # the labels the trainer's own Q(W) carries (weight sync checks)
    labels = dict(tile=rule["tile"], scale_rule=rule["scale_rule"])
    for name, (data, block_scale, g) in packed.items():
        m = modules[name]
        if not isinstance(m, NVFP4Linear) or m.mode != activations:
            raise ValueError(f"{path}: the recovered precision contract makes {name} "
                             f"{getattr(m, 'mode', 'bf16')}, the checkpoint holds it {activations}")
        q = _nvfp4(data, block_scale, g, m.weight.dtype, **labels)
        _install(m, q)
    _warn_unfused_scales(path, model, packed)
    model.precision_contract = contract
    return model, load_tokenizer(path), contract


def _check_scales(path: Path, name: str, block_scale: torch.Tensor, g: torch.Tensor) -> None:
    """Refuse scales no quantizer writes: a decode global scale that is not finite and > 0 (ModelOpt's
    weight_scale_2; 1 / compressed-tensors' weight_global_scale), E4M3 block scales that are NaN (0x7F / 0xFF)
    or negative (-0 is 0). They would load as NaN, zero or sign-flipped weights without a word."""
    if not (bool(torch.isfinite(g)) and float(g) > 0):
        raise ValueError(f"{path}: {name} has the weight global scale (decode direction) {float(g)!r}; it "
                         "must be finite and > 0 (a compressed-tensors weight_global_scale of 0, NaN or < 0, "
                         "or a ModelOpt weight_scale_2 of 0, NaN, Inf or < 0): the checkpoint is damaged or "
                         "was written wrongly; export it again")
    b = block_scale.view(torch.uint8)
    bad = ((b & 0x7F) == 0x7F) | ((b & 0x80) != 0) & (b != 0x80)
    if bool(bad.any()):
        first = bad.nonzero()[0].tolist()
        raise ValueError(f"{path}: {name} has {int(bad.sum())} E4M3 block scales that are NaN or negative "
                         f"(the first at [row, block] {first}: byte 0x{int(b[tuple(first)]):02X}); NVFP4 "
                         "block scales are finite and >= 0: the checkpoint is damaged or was written wrongly")


def _warn_unfused_scales(path: Path, model, packed: dict) -> None:
    """Warn when a group servers fuse into one GEMM (q/k/v, gate/up) holds different weight global
    scales: another producer's checkpoint may; fp4rl's export refuses to write one."""
    unequal = []
    for group in fused_groups(model):
        scales = [packed[n][2].reshape(()) for n in group if n in packed]
        if any(not torch.equal(g, scales[0]) for g in scales):
            unequal.append((group, [g.item() for g in scales]))
    if unequal:
        group, scales = unequal[0]
        warnings.warn(f"{path}: {len(unequal)} fused group(s) hold different weight global scales, e.g. "
                      f"{', '.join(group)}: {scales}. vLLM runs each group as one GEMM with one global scale "
                      "(for q/k/v and gate/up the largest stored weight_scale_2 / weight_global_scale; for a "
                      "routed expert's gate/up, the gate's), so it serves the other members' weights "
                      "rescaled. fp4rl's import computes each linear with its own scale: it does not compute "
                      "what vLLM serves from this checkpoint", stacklevel=3)


def _nvfp4(data, block_scale, g, dtype, tile=16, scale_rule="6") -> NVFP4Tensor:
    n, k = data.shape[0], data.shape[1] * 2
    return NVFP4Tensor(data=data, block_scale=block_scale, global_scale=g.reshape(()),
                       shape=torch.Size((n, k)), dtype=dtype, tile=tile, scale_rule=scale_rule)


def _install(module: NVFP4Linear, q: NVFP4Tensor) -> None:
    """Make `q` the module's quantized weight until its weights change (qat's cache: the key is
    the one NVFP4Linear.quantized_weight computes over its scale group)."""
    weights = [m.weight for m in module.scale_group]
    module._qweight = q
    module._qweight_key = [(w._version, w.data_ptr(), w.dtype, w.device, tuple(w.shape)) for w in weights]
    if module.quantized_weight() is not q:
        raise RuntimeError("fp4rl.qat.NVFP4Linear changed how it caches Q(W); update export_import._install")


def _contract(model, quantized: set[str], activations: str, manifest: dict | None) -> PrecisionContract:
    """The precision contract that resolves to exactly `quantized` in mode `activations`."""
    want = {n: (activations if n in quantized else "bf16")
            for n, m in model.named_modules() if is_linear(m)}
    missing = quantized - set(want)
    if missing:
        raise ValueError(f"checkpoint quantizes {sorted(missing)[:3]}, which are not linears of the model")

    def matches(contract):
        try:
            return contract.resolve(model) == want
        except ValueError:
            return False

    layers = {i for n in want if (i := layer_index(n)) is not None}
    num_layers = max(layers) + 1 if layers else 0
    quantized_layers = sorted({layer_index(n) for n in quantized} - {None})
    last = 0
    while last < num_layers and num_layers - 1 - last not in quantized_layers:
        last += 1
    # routed experts in the exported mode, layer by layer (a glob over all layers would also
    # reach the BF16 last layers, since rules override the last-layer rule)
    experts_mode = tuple((f"model.layers.{i}.mlp.experts.*", activations) for i in quantized_layers)
    base = dict(preset="nvfp4-linear", rules=(), bf16_last_fraction=last / num_layers if num_layers else 0.15)
    bases = [base]
    if manifest is not None and isinstance(manifest.get("precision"), dict):  # fp4rl's own export
        fields = {f.name for f in dataclasses.fields(PrecisionContract)}
        p = {k: v for k, v in manifest["precision"].items() if k in fields}
        bases.insert(0, {**p, "rules": tuple(tuple(r) for r in p.get("rules", ()))})
        settings = {k: v for k, v in p.items() if k not in ("preset", "rules", "bf16_last_fraction")}
        base.update(settings)
    for b in bases:  # the contract as written, then with the exported activation mode
        swapped = {"nvfp4-linear": "nvfp4-w4a16", "nvfp4-w4a16": "nvfp4-linear"}.get(b["preset"], b["preset"])
        for preset, extra in ((b["preset"], ()), (swapped, ()), ("nvfp4-experts", ()),
                              ("nvfp4-experts", experts_mode)):
            candidate = PrecisionContract(**{**b, "preset": preset, "rules": (*b["rules"], *extra)})
            if matches(candidate):
                return candidate
    settings = {k: v for k, v in base.items() if k not in ("preset", "rules", "bf16_last_fraction")}
    rules = tuple((n, activations) for n in sorted(quantized))  # explicit, one rule per linear
    candidate = PrecisionContract(preset="bf16", rules=rules, **settings)
    if not matches(candidate):
        routers = [n for n in quantized if module_kind(n) == "router"]
        why = f" (it quantizes routers {routers[:3]}, which fp4rl keeps BF16)" if routers else ""
        raise ValueError(f"no precision contract reproduces the checkpoint's quantized linears{why}")
    return candidate

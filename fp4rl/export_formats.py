"""The two NVFP4 checkpoint formats vLLM and SGLang load: ModelOpt and compressed-tensors.

Both store, per quantized linear `name` (a [N, K] weight), the same three things fp4rl's
NVFP4Tensor holds, under different names and with the global scale in different directions:

    ModelOpt (hf_quant_config.json, quant_algo "NVFP4" = W4A4 or "W4A16_NVFP4"):
        name.weight          uint8 [N, K/2]     E2M1 codes, element 2i in the low nibble
        name.weight_scale    float8_e4m3fn [N, K/16]
        name.weight_scale_2  float32 []         DECODE direction: g = amax/2688 (amax/1536 with
                                                4/6 weights), fp4rl's own
        name.input_scale     float32 []         DECODE direction, W4A4 only
    compressed-tensors (config.json quantization_config, format "nvfp4-pack-quantized"):
        name.weight_packed        uint8 [N, K/2]
        name.weight_scale         float8_e4m3fn [N, K/16]
        name.weight_global_scale  float32 [1]   ENCODE direction: G = 1/g
        name.input_global_scale   float32 [1]   ENCODE direction, W4A4 only

A value decodes as e2m1 * block_scale * g. The codes and block scales are written byte for
byte as the trainer's forward used them; 4/6 block scales are ordinary E4M3 values.

ModelOpt carries g itself, so its bytes are exactly the trained ones. compressed-tensors
carries G, and vLLM/SGLang recover g' = fp32(1/G) when loading. `encode_global_scale` picks
the G whose reciprocal is exactly g when one exists (about 86% of fp32 values; an fp32
reciprocal does not reach every fp32 value); otherwise g' differs from g by one ulp (a relative
6e-8). `export` reports how many tensors that is; ModelOpt has no such loss.

Activation scales. fp4rl quantizes activations per token, online. Both formats need one static
per-tensor input scale for W4A4: it comes from the activation amax observed on calibration
prompts (input_scale = amax/2688, with rule "6" as servers quantize). Servers that scale
activations per token ignore it.
"""

from __future__ import annotations

import fnmatch
import re

import torch

from fp4rl.nvfp4 import NVFP4Tensor
from fp4rl.nvfp4.format import true_div

FORMATS = ("modelopt", "compressed-tensors")
ACTIVATIONS = ("w4a16", "w4a4")
GROUP_SIZE = 16
CT_FORMAT = "nvfp4-pack-quantized"
HF_QUANT_CONFIG = "hf_quant_config.json"
MODELOPT_ALGO = {"w4a4": "NVFP4", "w4a16": "W4A16_NVFP4"}
FP32_MAX = torch.finfo(torch.float32).max


def reciprocal(x: torch.Tensor) -> torch.Tensor:
    """fp32(1/x), correctly rounded (what a server computes when it inverts a stored scale)."""
    return true_div(torch.ones_like(x, dtype=torch.float32), x.float())


def encode_global_scale(g: torch.Tensor) -> torch.Tensor:
    """The encode-direction scale G for a decode-direction scale g (any shape, float32):
    fp32(1/g), or the fp32 neighbour of it whose reciprocal is exactly g when that one is."""
    g = g.float()
    best = reciprocal(g)
    for direction in (FP32_MAX, 0.0):
        near = torch.nextafter(best, torch.full_like(best, direction))
        hit = (reciprocal(near) == g) & (reciprocal(best) != g)
        best = torch.where(hit, near, best)
    return best


def excluded(name: str, patterns: list[str]) -> bool:
    """Whether module `name` is listed in an exclude/ignore list as the servers read one: an
    exact name, a glob (ModelOpt), or 're:REGEX' matched from the start (compressed-tensors)."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p == name or fnmatch.fnmatchcase(name, p):
            return True
    return False


def _bytes(q: NVFP4Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if len(q.shape) != 2 or q.shape[1] % GROUP_SIZE or q.hadamard_seed is not None:
        raise ValueError(f"export: {name} is an NVFP4Tensor of shape {tuple(q.shape)} with hadamard_seed="
                         f"{q.hadamard_seed}; the formats hold 2D weights with K a multiple of 16 and no "
                         "Hadamard transform")
    if q.global_scale.numel() != 1:
        raise ValueError(f"export: {name} has a per-row global scale; the formats hold one per tensor")
    g = q.global_scale.reshape(()).cpu().float()
    if g == 0:  # an all-zero weight (amax 0): every block scale and code is 0, and any scale decodes them
        if bool(q.block_scale.float().any()):  # to zeros; 1 keeps the formats' scales finite (not 1/0)
            raise ValueError(f"export: {name} has global scale 0 but non-zero block scales: not an NVFP4 "
                             "tensor the quantizer writes")
        g = torch.ones_like(g)
    return q.data.cpu().contiguous(), q.block_scale.cpu().contiguous(), g


class ModelOpt:
    """NVIDIA ModelOpt's unified Hugging Face NVFP4 checkpoint."""

    name = "modelopt"

    @staticmethod
    def linear_tensors(name: str, q: NVFP4Tensor, input_scale: torch.Tensor | None) -> dict:
        data, block_scale, g = _bytes(q, name)
        out = {f"{name}.weight": data, f"{name}.weight_scale": block_scale, f"{name}.weight_scale_2": g}
        if input_scale is not None:
            out[f"{name}.input_scale"] = input_scale.reshape(()).float()
        return out

    @staticmethod
    def configs(activations: str, exclude: list[str], producer: dict) -> tuple[dict, dict]:
        """-> (extra JSON files {file name: content}, config.json's quantization_config)."""
        algo = MODELOPT_ALGO[activations]
        hf_quant = {"producer": producer,
                    "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None,
                                     "group_size": GROUP_SIZE, "exclude_modules": exclude}}
        weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE}
        group = {"weights": weights, "targets": ["Linear"]}
        if activations == "w4a4":
            group["input_activations"] = dict(weights)
        quantization_config = {"quant_method": "modelopt", "quant_algo": algo, "group_size": GROUP_SIZE,
                               "kv_cache_quant_algo": None, "kv_cache_scheme": None, "ignore": exclude,
                               "config_groups": {"group_0": group}, "producer": producer}
        return {HF_QUANT_CONFIG: hf_quant}, quantization_config

    @staticmethod
    def read_settings(config: dict, hf_quant: dict | None) -> tuple[str, list[str]]:
        """-> (activations, exclude list) from hf_quant_config.json or config.json."""
        if hf_quant is not None:
            q = hf_quant.get("quantization")
            source = HF_QUANT_CONFIG
            if not isinstance(q, dict):
                raise ValueError(f"{HF_QUANT_CONFIG}: no 'quantization' table")
            algo, exclude, group = q.get("quant_algo"), q.get("exclude_modules"), q.get("group_size")
        else:
            q, source = config["quantization_config"], "config.json quantization_config"
            algo, exclude, group = q.get("quant_algo"), q.get("ignore"), q.get("group_size", GROUP_SIZE)
        algo = str(algo).upper()
        modes = {v: k for k, v in MODELOPT_ALGO.items()}
        if algo not in modes:
            raise ValueError(f"{source}: quant_algo={algo!r} is not NVFP4; fp4rl reads "
                             f"{sorted(modes)} checkpoints")
        if group != GROUP_SIZE:
            raise ValueError(f"{source}: group_size={group!r}; NVFP4 has one scale per 16 values")
        if not isinstance(exclude, list):
            raise ValueError(f"{source}: the exclude list must be a list of module names, got {exclude!r}")
        return modes[algo], exclude

    @staticmethod
    def quantized_names(tensors: dict) -> list[str]:
        return sorted(k.removesuffix(".weight") for k, t in tensors.items()
                      if k.endswith(".weight") and t.dtype == torch.uint8)

    @staticmethod
    def pop_linear(tensors: dict, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove a linear's quantized tensors -> (data, block_scale, decode global scale [])."""
        data = tensors.pop(f"{name}.weight")
        block_scale = _pop(tensors, name, "weight_scale")
        g = _pop(tensors, name, "weight_scale_2", scalar=True)
        tensors.pop(f"{name}.input_scale", None)
        return data, block_scale, g.float().reshape(())


class CompressedTensors:
    """compressed-tensors' nvfp4-pack-quantized format (what llm-compressor writes)."""

    name = "compressed-tensors"

    @staticmethod
    def linear_tensors(name: str, q: NVFP4Tensor, input_scale: torch.Tensor | None) -> dict:
        data, block_scale, g = _bytes(q, name)
        out = {f"{name}.weight_packed": data, f"{name}.weight_scale": block_scale,
               f"{name}.weight_global_scale": encode_global_scale(g).reshape(1)}
        if input_scale is not None:
            out[f"{name}.input_global_scale"] = encode_global_scale(input_scale.float()).reshape(1)
        return out

    @staticmethod
    def configs(activations: str, exclude: list[str], producer: dict) -> tuple[dict, dict]:
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": GROUP_SIZE,
                   "strategy": "tensor_group", "dynamic": False}
        inputs = None
        if activations == "w4a4":  # a static global scale, block scales computed at run time
            inputs = {**weights, "dynamic": "local", "observer": "static_minmax"}
        group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                 "output_activations": None, "format": CT_FORMAT}
        quantization_config = {"quant_method": "compressed-tensors", "format": CT_FORMAT,
                               "quantization_status": "compressed", "config_groups": {"group_0": group},
                               "ignore": exclude, "kv_cache_scheme": None, "global_compression_ratio": None,
                               "producer": producer}
        return {}, quantization_config

    @staticmethod
    def read_settings(config: dict, hf_quant: dict | None) -> tuple[str, list[str]]:
        q = config["quantization_config"]
        where = "config.json quantization_config"
        groups = q.get("config_groups") or {}
        if q.get("format") != CT_FORMAT or len(groups) != 1:
            raise ValueError(f"{where}: format={q.get('format')!r} with {len(groups)} config groups; fp4rl "
                             f"reads one '{CT_FORMAT}' group (NVFP4 weights)")
        (group,) = groups.values()
        w, x = group.get("weights") or {}, group.get("input_activations")
        nvfp4 = dict(num_bits=4, type="float", group_size=GROUP_SIZE, strategy="tensor_group")
        for key, value in nvfp4.items():
            for label, args in (("weights", w), ("input_activations", x or {})):
                if (label == "weights" or x) and args.get(key) != value:
                    raise ValueError(f"{where}: {label}.{key}={args.get(key)!r}; NVFP4 needs {value!r}")
        ignore = q.get("ignore", [])
        if not isinstance(ignore, list):
            raise ValueError(f"{where}: ignore must be a list of module names, got {ignore!r}")
        return ("w4a4" if x else "w4a16"), ignore

    @staticmethod
    def quantized_names(tensors: dict) -> list[str]:
        return sorted(k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed"))

    @staticmethod
    def pop_linear(tensors: dict, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        data = tensors.pop(f"{name}.weight_packed")
        block_scale = _pop(tensors, name, "weight_scale")
        g = _pop(tensors, name, "weight_global_scale", scalar=True)
        g = reciprocal(g.float().reshape(()))  # as servers do
        tensors.pop(f"{name}.input_global_scale", None)
        return data, block_scale, g


FORMAT_CLASSES = {"modelopt": ModelOpt, "compressed-tensors": CompressedTensors}


def detect(config: dict, has_hf_quant_config: bool) -> str | None:
    """The format of a checkpoint directory from its config.json (and whether it has an
    hf_quant_config.json), or None for an unquantized one."""
    q = config.get("quantization_config")
    method = str((q or {}).get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return "compressed-tensors"
    if method.startswith("modelopt") or (has_hf_quant_config and not q):
        return "modelopt"
    return None


def _pop(tensors: dict, name: str, field: str, scalar: bool = False) -> torch.Tensor:
    key = f"{name}.{field}"
    if key not in tensors:
        raise ValueError(f"checkpoint has the packed weight of {name} but no {key}")
    t = tensors.pop(key)
    if scalar and t.numel() != 1:
        raise ValueError(f"checkpoint {key} holds {t.numel()} values {list(t.shape)}; fp4rl reads NVFP4 "
                         "with one global scale per weight tensor")
    return t

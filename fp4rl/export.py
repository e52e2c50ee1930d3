"""Serve what you trained: write an NVFP4 checkpoint that vLLM and SGLang load.

    fp4rl export SRC OUT --format modelopt|compressed-tensors [--activations w4a16|w4a4]
                         [--precision PRESET] [--calib-prompts N] [--dtype bfloat16] [--force]
                         [--tokenizer DIR | --no-tokenizer]

SRC is a run directory (its latest checkpoint), a checkpoint directory (runs/<name>/
checkpoints/step_*: the precision contract comes from its config.toml), or a model (a Hugging
Face directory or "default", with --precision). OUT becomes a Hugging Face directory:
config.json (with quantization_config), safetensors, the tokenizer, generation_config.json when
the source has one, hf_quant_config.json (ModelOpt), README.md with the commands that serve it,
and fp4rl_manifest.json (the sha256 of every file; `fp4rl.load_model(OUT)` refuses a file that
changed after export). The tokenizer comes from SRC, a run's model.name or --tokenizer DIR; when
none is found the export is refused before anything is written, unless --no-tokenizer says to
write none (W4A4 input scales are then calibrated on seeded random token ids).

What is written (the tensors of each format: fp4rl/export_formats.py):
- every linear the precision contract quantizes, as the NVFP4 bytes the trainer's forward
  computes with (`qat.packed_state`, not a re-quantization). Fused groups (q/k/v and gate/up of
  one block, each expert's gate/up) share one weight global scale, as servers fuse them into one
  GEMM with one scale; a group that does not (different precisions, or scales not fused) is
  refused rather than served differently from how it was trained;
- routed experts one by one, `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.*`, the
  per-expert layout the servers' MoE loaders stack themselves; a layer must have all its experts
  in one precision (servers run one fused MoE per layer);
- every other tensor (the contract's BF16 modules, embeddings, norms, biases) in `dtype`, and
  every BF16 linear listed by name in exclude_modules / ignore. When a layer's routed experts
  are all BF16 the list also names the layer's `...mlp.experts` (the servers' fused MoE module);
- W4A4: one static input scale per linear from the activation amax on `calib_prompts` built-in
  prompts (see export_formats.py); a layer's routed experts share two, the MoE input's for gate/up
  and the largest down_proj input's for down_proj (an expert sees few calibration tokens). W4A16
  has none;
- an all-zero quantized weight with global scale 1 (its block scales and codes are 0); an NVFP4
  lm_head is refused (servers load lm_head as their BF16 vocabulary-parallel head).
The NVFP4 arithmetic is fp4rl's own; compressed-tensors and ModelOpt are used only in the tests,
as oracles that their loaders read back the same values.

Import: `fp4rl.load_model(OUT)` (fp4rl/export_import.py) rebuilds the model with its quantized
linears holding exactly these bytes, to evaluate or to continue RL.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

from fp4rl import __version__
from fp4rl.export_files import MANIFEST, check_out, readme, sha256, write_dir, write_json
from fp4rl.export_formats import ACTIVATIONS, FORMAT_CLASSES, FORMATS, encode_global_scale, reciprocal
from fp4rl.hf import write_safetensors
from fp4rl.moe import SparseMoeBlock
from fp4rl.nvfp4 import global_scales_from_amax
from fp4rl.precision import PRESETS, PrecisionContract, is_linear
from fp4rl.qat import convert, packed_state

FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # one GEMM in servers
FUSED_NAMES = {("q_proj", "k_proj", "v_proj"): "qkv_proj", ("gate_proj", "up_proj"): "gate_up_proj"}
CALIBRATION_PROMPTS = (
    "What is 17 + 25? Answer with the number only.",
    "Write a short poem about the sea at night.",
    "Explain in two sentences why the sky is blue.",
    "def fibonacci(n):\n    # return the n-th Fibonacci number\n",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "List three prime numbers greater than 50.",
    "A train leaves at 3:15 pm and travels for 2 hours 50 minutes. When does it arrive?",
    "Summarize the rules of chess for a beginner.",
    "Solve for x: 3x - 7 = 11.",
    "What are the main causes of inflation?",
    "Give me a recipe for a simple tomato soup.",
    "In which year did the first human land on the Moon?",
    "Write a SQL query that counts the rows of a table named users.",
    "Compute the greatest common divisor of 84 and 36.",
    "Describe the water cycle to a ten-year-old.",
    "How many letters 'r' are in the word strawberry?",
)


def export(source: str | os.PathLike, out: str | os.PathLike, *, format: str = "modelopt",
           activations: str | None = None, precision: str | None = None, calib_prompts: int = 8,
           dtype: torch.dtype | str = torch.bfloat16, tokenizer: str | os.PathLike | None = None,
           no_tokenizer: bool = False, overwrite: bool = False) -> Path:
    """Export SRC (run dir, checkpoint dir, HF model dir or "default") to OUT. -> OUT.

    precision: a preset name; for a checkpoint it replaces the preset of its config.toml (the
    other quantizer settings stay the run's). tokenizer: where to read the tokenizer from when
    the source has none (default: the run config's model.name). No tokenizer found is an error
    unless no_tokenizer=True: then OUT has none and W4A4 calibrates on seeded random token ids."""
    from fp4rl.hf import TOKENIZER_FILES, load_model, load_tokenizer

    if tokenizer is not None and no_tokenizer:
        raise ValueError("export: pass a tokenizer (--tokenizer) or no_tokenizer=True (--no-tokenizer), "
                         "not both")

    if not 1 <= calib_prompts <= len(CALIBRATION_PROMPTS):
        raise ValueError(f"export: calib_prompts={calib_prompts}; use 1..{len(CALIBRATION_PROMPTS)} built-in "
                         "prompts (--calib-prompts)")
    src = _resolve_source(source)
    files = f"tokenizer files ({', '.join(TOKENIZER_FILES)})"
    contract, tok_dir, missing = None, src, f"{src} has no {files}"
    if (src / "config.toml").is_file() and (src / "trainer.pt").is_file():  # a trainer checkpoint
        from fp4rl.config import load_config

        cfg = load_config(src / "config.toml")
        kwargs = cfg.precision.contract_kwargs()
        contract = PrecisionContract(**{**kwargs, "preset": precision or kwargs["preset"]})
        tok_dir = Path(tokenizer) if tokenizer else _model_dir(cfg.model.name)
        if tok_dir is None:
            missing = (f"the run's model.name {cfg.model.name!r} (where its tokenizer lives) is not on this "
                       "machine, neither a folder nor in the Hugging Face cache")
    elif precision is None:
        raise ValueError(f"{source} is a model, not a run checkpoint (no config.toml + trainer.pt): pass "
                         f"--precision PRESET (one of {PRESETS}) to say which linears are NVFP4")
    else:
        contract = PrecisionContract(preset=precision)
        tok_dir = Path(tokenizer) if tokenizer else src
    if tok_dir is not None and tok_dir != src:
        missing = f"{tok_dir} has no {files}"
    if not no_tokenizer and (tok_dir is None or not any((tok_dir / f).is_file() for f in TOKENIZER_FILES)):
        raise ValueError(f"export: no tokenizer for {source}: {missing}. "
                         "vLLM and SGLang read the tokenizer from OUT, and W4A4 calibration tokenizes its "
                         "prompts with it: pass --tokenizer DIR (tokenizer=DIR), a folder holding the base "
                         "model's tokenizer, or --no-tokenizer (no_tokenizer=True) to export without one "
                         "(W4A4 input scales then come from seeded random token ids; give the server a "
                         "tokenizer)")
    target = Path(out).resolve()
    held = [(src, f"the source {source}"), (tok_dir, f"the tokenizer source {tok_dir}")]
    if str(source) != "default":  # for a run, the run directory named as well as its checkpoint
        held.append((Path(source), f"the source {source}"))
    for path, what in held:
        if path is not None and (target == path.resolve() or target in path.resolve().parents):
            raise ValueError(f"export: OUT {out} is {what} or a folder holding it; replacing it (--force) "
                             "would delete it: pick another OUT")
    check_out(target, overwrite)  # now, not after minutes of loading and packing
    with warnings.catch_warnings():  # checked above: the tokenizer comes from tok_dir, or none is wanted
        warnings.filterwarnings("ignore", ".*has no tokenizer files")
        model, tok = load_model(src, dtype=torch.float32)
    recovered = getattr(model, "precision_contract", None)  # an NVFP4 checkpoint's own (its manifest's)
    if recovered is not None and recovered.preset == contract.preset and precision is not None \
            and not (src / "trainer.pt").is_file():
        contract = recovered  # the same preset: keep the settings its bytes were quantized with
    if no_tokenizer:
        tok = None
    elif tok_dir != src:
        tok = load_tokenizer(tok_dir)
    generation_config = next((d / "generation_config.json" for d in (src, tok_dir)
                              if d is not None and (d / "generation_config.json").is_file()), None)
    return export_model(model, contract, out, format=format, activations=activations, tokenizer=tok,
                        calib_prompts=calib_prompts, calib_ids="random" if no_tokenizer else None,
                        dtype=dtype, source=str(source),
                        generation_config=generation_config, overwrite=overwrite)


def export_model(model: nn.Module, contract: PrecisionContract, out: str | os.PathLike, *,
                 format: str = "modelopt", activations: str | None = None, tokenizer=None,
                 calib_prompts: int = 8, calib_ids: list[list[int]] | str | None = None,
                 dtype: torch.dtype | str = torch.bfloat16, source: str = "",
                 generation_config: str | os.PathLike | None = None, max_shard_bytes: int = 5 * 2**30,
                 overwrite: bool = False) -> Path:
    """Write `model` (converted in place with `contract`, as the trainer does) to OUT in `format`.

    activations: "w4a4" or "w4a16" for every quantized linear (default: the contract's mode, which
    must then be one). calib_ids: token id lists for the W4A4 input scales (default:
    `calib_prompts` built-in prompts through `tokenizer`, which W4A4 then needs), or "random" for
    `calib_prompts` lists of seeded random token ids."""
    if format not in FORMATS:
        raise ValueError(f"export: format={format!r}; use one of {FORMATS}")
    dtype = getattr(torch, str(dtype).removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"export: dtype={dtype!r} must be a floating torch dtype (e.g. bfloat16)")
    fmt = FORMAT_CLASSES[format]
    resolved = contract.resolve(model)
    modes = {p for p in resolved.values() if p != "bf16"}
    if not modes:
        raise ValueError(f"export: the precision contract (preset {contract.preset!r}) quantizes no linear; "
                         "nothing to export in NVFP4 (use fp4rl.hf.save_model for a BF16 checkpoint)")
    if activations is None:
        if len(modes) > 1:
            raise ValueError(f"export: the contract mixes {sorted(modes)} linears and a checkpoint has one "
                             "activation mode: pass activations='w4a4' or 'w4a16' (--activations)")
        (activations,) = modes
    if activations not in ACTIVATIONS:
        raise ValueError(f"export: activations={activations!r}; use one of {ACTIVATIONS}")
    if activations == "w4a4" and tokenizer is None and calib_ids is None:
        raise ValueError("export: W4A4 input scales are calibrated on built-in prompts, which need a "
                         "tokenizer: pass tokenizer=, calib_ids=[[token ids], ...], or calib_ids='random' "
                         "for seeded random token ids (what --no-tokenizer does)")
    if isinstance(calib_ids, str) and calib_ids != "random":
        raise ValueError(f"export: calib_ids={calib_ids!r}; pass token id lists or 'random'")
    if modes != {activations}:
        warnings.warn(f"export: linears trained {sorted(modes)} are exported {activations}: the server "
                      f"{'quantizes' if activations == 'w4a4' else 'does not quantize'} their activations, "
                      "so it computes another function than the trainer did", stacklevel=2)
    _check_finite(model)
    modules = dict(model.named_modules())
    if any(getattr(modules[n], "mode", "bf16") != p for n, p in resolved.items()):
        convert(model, contract)  # else keep its NVFP4Linears: their cached bytes are the forward's
    else:  # ... and the manifest must then record the settings that made those bytes
        want = (contract.weight_quantize_kwargs(), contract.input_quantize_kwargs())
        for n, p in resolved.items():
            have = (modules[n].weight_kwargs, modules[n].input_kwargs) if p != "bf16" else want
            if have != want:
                raise ValueError(f"export: {n} was converted (trained) with weight quantizer {have[0]} and "
                                 f"activation quantizer {have[1]}, the contract says {want[0]} and "
                                 f"{want[1]}: pass the contract the model was converted with (its bytes are "
                                 "exported as they are; quantizing DQ(Q(W)) again would not be the trained "
                                 "weights)")
    packed = packed_state(model)  # {name.weight: the bytes the forward computes with}
    _check_servable(model, resolved, packed)
    quantized = sorted(k.removesuffix(".weight") for k in packed)
    exclude = exclude_list(model, set(quantized), fused_names=format == "modelopt")

    calibration, input_scales = None, {}
    if activations == "w4a4":
        if calib_ids is None or calib_ids == "random":
            calib_ids, how = calibration_ids(None if calib_ids else tokenizer, calib_prompts,
                                             model.config.vocab_size)
        else:
            how = "token ids given by the caller"
        amax = observe_input_amax(model, calib_ids, quantized)
        input_scales = {n: _input_scale(a) for n, a in amax.items()}
        calibration = {"prompts": len(calib_ids), "tokens": sum(map(len, calib_ids)), "source": how}

    tensors = {}
    tied = model.config.tie_word_embeddings
    for key, t in model.state_dict().items():
        module = key.rpartition(".")[0]
        if tied and key == "lm_head.weight":
            continue
        if key in packed:
            tensors.update(fmt.linear_tensors(module, packed[key], input_scales.get(module)))
        else:
            tensors[key] = t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
    g = torch.stack([q.global_scale.reshape(()).cpu().float() for q in packed.values()])
    exact = int((reciprocal(encode_global_scale(g)) == g).sum()) if format == "compressed-tensors" else len(g)

    producer = {"name": "fp4rl", "version": __version__}
    extra_files, quantization_config = fmt.configs(activations, exclude, producer)
    config = model.config.to_hf()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["quantization_config"] = quantization_config
    manifest = {
        "producer": producer, "format": format, "activations": activations, "source": source,
        "dtype": config["torch_dtype"], "precision": _contract_dict(contract),
        "quantized_linears": len(quantized), "excluded_modules": len(exclude),
        "calibration": calibration,
        "global_scales": {"tensors": len(g), "exact": exact,
                          "note": "exact: the decode scale servers recover (fp32(1/G) for compressed-"
                                  "tensors) is bit-identical to the trained one; others differ by 1 ulp"},
    }

    def write(tmp: Path) -> None:
        write_safetensors(tensors, tmp, max_shard_bytes)
        write_json(tmp / "config.json", config)
        for name, content in extra_files.items():
            write_json(tmp / name, content)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if generation_config is not None:
            shutil.copyfile(generation_config, tmp / "generation_config.json")
        (tmp / "README.md").write_text(readme(Path(out).name, manifest, contract.summary(model)))
        manifest["files"] = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
                             for p in sorted(tmp.iterdir()) if p.is_file()}
        write_json(tmp / MANIFEST, manifest)

    return write_dir(Path(out), write, overwrite)


# ----------------------------------------------------------------------------------------------
# What the servers can load


def _check_finite(model: nn.Module) -> None:
    """Refuse a model with NaN/Inf in any parameter or buffer, naming it: a BF16 tensor would be written
    as it is (and served), a quantized one stopped the quantizer with a message naming no tensor."""
    for key, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t.detach())).sum())
            raise ValueError(f"export: {key} holds {bad} NaN/Inf of {t.numel()} values: the model diverged "
                             "or was damaged; export a checkpoint from before it (a run keeps the newest "
                             "trainer.checkpoint_keep: fp4rl export RUN/checkpoints/step_N OUT)")


def _check_servable(model: nn.Module, resolved: dict[str, str], packed: dict) -> None:
    """Refuse what a server would load differently from how it was trained (see module docstring)."""
    if model.config.tie_word_embeddings and "lm_head.weight" in packed:
        raise ValueError("export: lm_head is NVFP4 but tied to embed_tokens (tie_word_embeddings); a "
                         "checkpoint stores the tied weight once, as the embedding. Keep lm_head BF16")
    if "lm_head.weight" in packed:
        # servers build lm_head as their vocabulary-parallel head, not a quantized linear: compressed-tensors'
        # "Linear" target skips it (its packed bytes then go unread) and vLLM's ModelOpt loader quantizes it
        # only for a few architectures, so the model would be served with another (or no) head
        raise ValueError("export: lm_head is NVFP4 (a precision rule quantizes it); vLLM and SGLang load "
                         "lm_head as their BF16 vocabulary-parallel head and would not serve these bytes. "
                         "Keep lm_head BF16: every preset does, so drop the rule that quantizes it (a run's "
                         "precision.rules in its config.toml, or add ('lm_head', 'bf16') there) and train "
                         "with it")
    for full in fused_groups(model):
        precisions = {resolved.get(n) for n in full}
        if len(precisions) > 1:
            raise ValueError(f"export: {', '.join(full)} resolve to {[resolved.get(n) for n in full]}; "
                             "servers run them as one fused GEMM in one precision. Give them one "
                             "precision with a rule (e.g. ('*.self_attn.*_proj', ...)) and train with it")
        scales = [packed[f"{n}.weight"].global_scale.reshape(()) for n in full if f"{n}.weight" in packed]
        if scales and any(not torch.equal(s, scales[0]) for s in scales):
            raise ValueError(f"export: {', '.join(full)} have different weight global scales; servers "
                             "fuse them with one scale, which would change their weights. Train with "
                             "PrecisionContract(fuse_global_scales=True) (the default)")
    for parent_name, parent in model.named_modules():
        if isinstance(parent, SparseMoeBlock):
            prefix = f"{parent_name}." if parent_name else ""
            experts = {p for n, p in resolved.items() if n.startswith(f"{prefix}experts.")}
            if len(experts) > 1:
                raise ValueError(f"export: the routed experts of {parent_name} mix {sorted(experts)}; "
                                 "servers run one fused MoE per layer in one precision. Use one precision "
                                 "per layer")


def fused_groups(model: nn.Module) -> list[list[str]]:
    """Full names of the linears servers run as one GEMM: q/k/v and gate/up of every module holding
    them (attention, MLPs, shared experts, each routed expert)."""
    groups = []
    for parent_name, parent in model.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        for names in FUSED_GROUPS:
            if all(isinstance(getattr(parent, n, None), nn.Module) for n in names):
                groups.append([prefix + n for n in names])
    return groups


def exclude_list(model: nn.Module, quantized: set[str], fused_names: bool = False) -> list[str]:
    """Every linear not in `quantized`, by full name, plus `...mlp.experts` of each MoE layer
    whose routed experts are all BF16 (the module name servers check for a fused MoE). fused_names (the
    ModelOpt format): also `...qkv_proj` / `...gate_up_proj` where every member of the group is BF16,
    the names servers give the fused GEMM: SGLang's ModelOpt loader checks the fused module's own name
    against the list (vLLM maps it back to q/k/v; an extra name is harmless to it)."""
    names = {n for n, m in model.named_modules() if is_linear(m) and n not in quantized}
    for n, m in model.named_modules():
        if isinstance(m, SparseMoeBlock) and not any(q.startswith(f"{n}.experts.") for q in quantized):
            names.add(f"{n}.experts")
    if fused_names:
        for full in fused_groups(model):
            prefix = full[0].rpartition(".")[0]
            in_fused_moe = prefix.rpartition(".")[0] in names  # an expert of a listed `...mlp.experts`
            if all(n in names for n in full) and not in_fused_moe:
                names.add(f"{prefix}.{FUSED_NAMES[tuple(n.rpartition('.')[2] for n in full)]}")
    return sorted(names)


# ----------------------------------------------------------------------------------------------
# Calibration of the static input scales (W4A4)


def calibration_ids(tokenizer, n: int, vocab_size: int) -> tuple[list[list[int]], str]:
    """Token ids of the first n built-in prompts, or n lists of seeded random ids for tokenizer=None
    (export_model asks for them only when told to: calib_ids='random', --no-tokenizer)."""
    if not 1 <= n <= len(CALIBRATION_PROMPTS):
        raise ValueError(f"export: calib_prompts={n}; use 1..{len(CALIBRATION_PROMPTS)} built-in prompts")
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        ids = [torch.randint(0, vocab_size, (32,), generator=gen).tolist() for _ in range(n)]
        return ids, "random token ids (seed 0; exported without a tokenizer: --no-tokenizer)"
    return [tokenizer(p)["input_ids"] for p in CALIBRATION_PROMPTS[:n]], "built-in prompts"


@torch.no_grad()
def observe_input_amax(model: nn.Module, calib_ids: list[list[int]], quantized: list[str]) -> dict:
    """{linear name: amax of its input over the calibration tokens}. Gate/up of routed experts
    take their MoE block's input amax (every expert sees a subset of it; servers quantize it once
    before dispatch); a down_proj of an expert no calibration token reached takes the layer's max."""
    amax, hooks = {}, []

    def observe(name):
        def hook(_module, args):
            a = args[0].detach().abs().amax().float().cpu()
            amax[name] = torch.maximum(amax[name], a) if name in amax else a
        return hook

    modules = dict(model.named_modules())
    for name in quantized:
        hooks.append(modules[name].register_forward_pre_hook(observe(name)))
    blocks = [n for n, m in modules.items() if isinstance(m, SparseMoeBlock)]
    for name in blocks:
        hooks.append(modules[name].register_forward_pre_hook(observe(name)))
    device = next(model.parameters()).device
    try:
        for ids in calib_ids:
            model(torch.tensor([ids], device=device))
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for name in quantized:
        block = next((b for b in blocks if name.startswith(f"{b}.experts.")), None)
        if block is not None and name.endswith(("gate_proj", "up_proj")):
            out[name] = amax[block]
        elif block is not None:
            # every expert's down_proj takes the layer's largest: an expert sees few calibration tokens (one
            # or none), and a static scale below its real inputs would clip them at 6 x 448 x the scale
            seen = [amax[n] for n in quantized if n.startswith(f"{block}.experts.") and n in amax
                    and n.endswith("down_proj")]
            if not seen:
                raise ValueError(f"export: no calibration token reached any expert of {block}")
            out[name] = torch.stack(seen).amax()
        elif name in amax:
            out[name] = amax[name]
        else:
            raise ValueError(f"export: {name} saw no calibration input; it cannot get an input scale")
    return out


def _input_scale(amax: torch.Tensor) -> torch.Tensor:
    """Decode-direction static input scale amax/2688 (rule "6"); 1 for an all-zero input."""
    scale = global_scales_from_amax(amax.reshape(()), "6").global_scale
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _contract_dict(contract: PrecisionContract) -> dict:
    d = dataclasses.asdict(contract)
    d["rules"] = [list(r) for r in contract.rules]
    d["weight_tile"] = "16x16" if contract.weight_tile == (16, 16) else "1x16"
    return d


def _resolve_source(source) -> Path:
    from fp4rl.hf import default_model_dir
    from fp4rl.run_dirs import checkpoint_of

    if str(source) == "default":
        return default_model_dir(convert=True)
    path = Path(source).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"export: no such directory {source}; pass a run directory, a checkpoint "
                                "directory, a Hugging Face model directory or 'default'")
    return checkpoint_of(path, "export") or path


def _model_dir(name: str) -> Path | None:
    """The folder of a run's model.name ('default', a local folder or a Hub id in the local cache; the
    tokenizer and generation config come from it), or None when it is not on this machine."""
    from fp4rl.hf import _resolve, default_model_dir

    if name == "default":
        return default_model_dir(convert=True)
    try:
        return _resolve(name)
    except (FileNotFoundError, NotADirectoryError):
        return None


# ----------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser) -> None:
    parser.add_argument("source", metavar="SRC", help="a run directory, a checkpoint directory, a Hugging "
                        "Face model directory or 'default'")
    parser.add_argument("out", metavar="OUT",
                        help="directory to write (absent or empty, or an earlier export with --force)")
    parser.add_argument("--format", choices=FORMATS, default="modelopt",
                        help="checkpoint format (default modelopt)")
    parser.add_argument("--activations", choices=ACTIVATIONS, default=None,
                        help="activation mode of every quantized linear (default: the precision contract's)")
    parser.add_argument("--precision", choices=PRESETS, default=None,
                        help="precision preset (required for a model; overrides a checkpoint's preset)")
    parser.add_argument("--calib-prompts", type=int, default=8,
                        help=f"built-in prompts for the W4A4 input scales (1..{len(CALIBRATION_PROMPTS)})")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="dtype of the unquantized tensors (default bfloat16)")
    tokenizer = parser.add_mutually_exclusive_group()
    tokenizer.add_argument("--tokenizer", default=None, metavar="DIR",
                           help="tokenizer directory when the source has none (default: a run's model.name)")
    tokenizer.add_argument("--no-tokenizer", action="store_true",
                           help="export without a tokenizer (else one not found is an error); W4A4 input "
                                "scales are then calibrated on seeded random token ids")
    parser.add_argument("--force", action="store_true", help="replace OUT if it is an earlier fp4rl export")


def run(args) -> int:
    out = export(args.source, args.out, format=args.format, activations=args.activations,
                 precision=args.precision, calib_prompts=args.calib_prompts, dtype=args.dtype,
                 tokenizer=args.tokenizer, no_tokenizer=args.no_tokenizer, overwrite=args.force)
    manifest = json.loads((out / MANIFEST).read_text())
    print(f"{out}: {manifest['format']} {manifest['activations']}, {manifest['quantized_linears']} NVFP4 "
          f"linears, {manifest['excluded_modules']} excluded; serve it as {out / 'README.md'} says")
    return 0

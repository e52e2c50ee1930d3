"""PrecisionContract: which linears compute in NVFP4, and how.

The recipe (docs: MISSION.md, points 1-5) puts NVFP4 only where it pays and keeps the rest in
BF16. Every consumer (trainer, sampler, weight sync, exporter) asks the same contract, so they
agree on which module is quantized by construction:

    precision(module) in {"bf16", "w4a16", "w4a4"}

- "w4a4":  y = DQ(Q(x)) @ DQ(Q(W)).T + b; W quantized per tensor (one FP32 global scale),
           x per token (one FP32 global scale per row, computed online, mission point 2).
- "w4a16": y = x @ DQ(Q(W)).T + b (rollout-only presets; weights 3.56x fewer bytes).
- "bf16":  the module is left as it is.

Only `nn.Linear` modules can be NVFP4. Embeddings, norms and everything that is not a linear
stay in the model's own dtype whatever the contract says.

Resolution, for every nn.Linear of the model, in this order:
1. the preset gives a base precision from the module's *kind* (parsed from its Hugging Face
   name, see `module_kind`) and its decoder layer index (`model.layers.{i}.`):
     "bf16"          every linear BF16.
     "nvfp4-experts" routed experts (`.mlp.experts.{e}.*`) W4A4; shared experts, attention,
                     routers, lm_head BF16.
     "nvfp4-linear"  every decoder linear (inside `model.layers.{i}.`) W4A4 except routers.
     "nvfp4-w4a16"   every decoder linear W4A16 except routers (rollout only).
   In every NVFP4 preset the last `round(bf16_last_fraction * L)` decoder layers stay BF16
   (to the nearest, halves up, and at least one when the fraction is > 0; 0.15 by default: 7
   of 48 layers as in the recipe's Qwen3-30B-A3B, 5 of 30 (SmolLM2-135M), 5 of 36, 4 of 24).
   Routers (`.mlp.gate`, `.shared_expert_gate`) are never quantized by a preset: they make
   discrete expert choices, and a 4-bit router would make trainer and sampler route
   differently.
2. user rules, an ordered list of (glob, precision) matched with `fnmatch` against linear
   names (`*` also crosses dots). Every matching rule overrides the preset, and a later rule
   overrides an earlier one: the last matching rule wins. Rules may override the last-layer
   rule (e.g. ("model.layers.23.*", "w4a4")).

The contract refuses, with an error naming the key and the fix:
- on construction: an unknown preset, precision, error metric, tile or backward mode; a
  bf16_last_fraction outside [0, 1]; a malformed rule;
- in resolve(model): a rule that matches no nn.Linear (a typo, or a rule aimed at an
  embedding or norm, which cannot be NVFP4); a final resolution that quantizes a router;
  an NVFP4 lm_head in a model whose config ties it to the embeddings (tie_word_embeddings, which
  export refuses); an NVFP4 preset that finds nothing to quantize (no `model.layers.{i}.` in the model,
  "nvfp4-experts" on a dense model, or every layer among the BF16-kept last ones); routed
  experts stored as fused 3D parameters (the transformers 5 layout) instead of per-expert
  nn.Linear, which the preset could not convert.

4/6 (mission point 4) and its error metric are set separately for weights and activations;
the weight tile is 1x16 (one E4M3 scale per 16 values of a row) or 16x16 (one scale per tile:
the transposed copy is identical). With `fuse_global_scales` (default) the linears that
servers fuse into one GEMM, q/k/v_proj and gate/up_proj of one block, share one per-tensor
global scale computed from the amax of the whole group. The backward mode is "dequantized"
(the backward GEMMs use the exact operands of the forward, DQ(Q(W)) and DQ(Q(x))) or
"high_precision" (they use the original W and x); see fp4rl/qat.py.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field

import torch.nn as nn

PRECISIONS = ("bf16", "w4a16", "w4a4")
PRESETS = ("bf16", "nvfp4-experts", "nvfp4-linear", "nvfp4-w4a16")
BACKWARD_MODES = ("dequantized", "high_precision")
ERR_METRICS = ("mse", "mae")
KINDS = ("attention", "mlp", "routed_experts", "shared_experts", "router", "lm_head", "embeddings",
         "norms", "other")
_KIND_LABEL = {"routed_experts": "routed experts", "shared_experts": "shared experts"}

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_KIND_PATTERNS = (  # first match wins; matched against the module name
    ("embeddings", re.compile(r"(^|\.)(embed_tokens|wte|embeddings?)$")),
    ("norms", re.compile(r"(^|\.)[^.]*norm[^.]*$")),
    ("lm_head", re.compile(r"(^|\.)lm_head$")),
    ("router", re.compile(r"(^|\.)(mlp\.gate|shared_expert_gate|router)$")),
    ("routed_experts", re.compile(r"(^|\.)experts(\.|$)")),
    ("shared_experts", re.compile(r"(^|\.)shared_experts?(\.|$)")),
    ("attention", re.compile(r"(^|\.)self_attn(\.|$)")),
    ("mlp", re.compile(r"(^|\.)mlp(\.|$)")),
)


def module_kind(name: str) -> str:
    """Kind of a module from its Hugging Face name, one of KINDS."""
    for kind, pattern in _KIND_PATTERNS:
        if pattern.search(name):
            return kind
    return "other"


def layer_index(name: str) -> int | None:
    """Decoder layer index parsed from `...layers.{i}.`, or None outside the decoder layers."""
    m = _LAYER.search(name + ".")
    return int(m.group(1)) if m else None


def is_linear(module: nn.Module) -> bool:
    """nn.Linear, or a module standing in for one (qat.NVFP4Linear sets `is_linear = True`)."""
    return isinstance(module, nn.Linear) or getattr(module, "is_linear", False)


def _normalize_tile(tile):
    if tile in (16, (1, 16), [1, 16], "1x16", "16"):
        return 16
    if tile in ((16, 16), [16, 16], "16x16"):
        return (16, 16)
    raise ValueError(f"PrecisionContract.weight_tile={tile!r}: use 16 (1x16) or (16, 16) (16x16)")


@dataclass(frozen=True)
class PrecisionContract:
    preset: str = "bf16"
    """one of PRESETS: the base precision of every linear (see the module docstring)."""
    rules: tuple[tuple[str, str], ...] = field(default=())
    """ordered (glob over module names, precision) pairs; the last matching rule wins. A dict
    {glob: precision} (e.g. a TOML table) is accepted and keeps its order."""
    bf16_last_fraction: float = 0.15
    """fraction of the last decoder layers kept BF16 by NVFP4 presets (to the nearest, at least one)."""
    weight_four_over_six: bool = True
    """4/6 for weights: per block, keep the lower-error of max->6 and max->4 scalings."""
    weight_err: str = "mse"
    """error metric of the weights' 4/6 choice: "mse" or "mae"."""
    act_four_over_six: bool = True
    """4/6 for activations (W4A4 only)."""
    act_err: str = "mse"
    """error metric of the activations' 4/6 choice: "mse" or "mae"."""
    weight_tile: int | tuple[int, int] = 16
    """weight scale tile: 16 (1x16, one scale per 16 values of a row) or (16, 16)."""
    backward: str = "dequantized"
    """"dequantized" (backward on DQ(Q(W)), DQ(Q(x))) or "high_precision" (on W, x)."""
    fuse_global_scales: bool = True
    """q/k/v_proj and gate/up_proj of one block share one weight global scale (amax of the group),
    as servers fuse them into one GEMM with one scale: the served bytes are the trained bytes."""

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"PrecisionContract.preset={self.preset!r}: unknown preset; "
                             f"use one of {PRESETS}")
        if isinstance(self.bf16_last_fraction, bool) or not isinstance(self.bf16_last_fraction, int | float) \
                or not 0.0 <= self.bf16_last_fraction <= 1.0:
            raise ValueError(f"PrecisionContract.bf16_last_fraction={self.bf16_last_fraction!r}: "
                             "must be a number in [0, 1] (0.15 keeps the last 15% of layers BF16)")
        for key in ("weight_err", "act_err"):
            if getattr(self, key) not in ERR_METRICS:
                raise ValueError(f"PrecisionContract.{key}={getattr(self, key)!r}: use one of {ERR_METRICS}")
        for key in ("weight_four_over_six", "act_four_over_six", "fuse_global_scales"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"PrecisionContract.{key}={getattr(self, key)!r}: must be True or False")
        for side in ("weight", "act"):  # the error measure picks between the 4/6 scalings: without them, none
            err = getattr(self, f"{side}_err")
            if err != "mse" and not getattr(self, f"{side}_four_over_six"):
                raise ValueError(f"PrecisionContract.{side}_err={err!r} chooses between the 4/6 scalings, "
                                 f"but {side}_four_over_six is False (every block scaled to 6, nothing to "
                                 f"choose): set {side}_four_over_six = true, or drop {side}_err")
        if self.backward not in BACKWARD_MODES:
            raise ValueError(f"PrecisionContract.backward={self.backward!r}: use one of {BACKWARD_MODES}")
        object.__setattr__(self, "weight_tile", _normalize_tile(self.weight_tile))
        rules = self.rules.items() if isinstance(self.rules, dict) else self.rules
        normalized = []
        for rule in rules:
            if not (isinstance(rule, tuple | list) and len(rule) == 2
                    and isinstance(rule[0], str) and rule[0]):
                raise ValueError(f"PrecisionContract.rules: {rule!r} is not a (glob, precision) pair")
            pattern, precision = rule
            if precision not in PRECISIONS:
                raise ValueError(f"PrecisionContract.rules: {pattern!r} -> {precision!r}: "
                                 f"precision must be one of {PRECISIONS}")
            normalized.append((pattern, precision))
        object.__setattr__(self, "rules", tuple(normalized))

    # -- quantizer settings -------------------------------------------------------------------
    def weight_quantize_kwargs(self) -> dict:
        """kwargs of fp4rl.nvfp4.quantize for weights: per-tensor global scale."""
        return dict(tile=self.weight_tile, scale_rule="4/6" if self.weight_four_over_six else "6",
                    err=self.weight_err, scale_scope="tensor")

    def input_quantize_kwargs(self) -> dict:
        """kwargs of fp4rl.nvfp4.quantize for activations: 1x16 blocks, per-token global scale."""
        return dict(tile=16, scale_rule="4/6" if self.act_four_over_six else "6",
                    err=self.act_err, scale_scope="row")

    # -- resolution ---------------------------------------------------------------------------
    def bf16_last_layers(self, num_layers: int) -> range:
        """Indices of the last decoder layers an NVFP4 preset keeps BF16: fraction * L to the nearest
        (halves up: 0.15 * 30 = 4.5 -> 5), at least one for a fraction > 0 (7 of 48, 1 of 4)."""
        f = self.bf16_last_fraction
        # the epsilon keeps a product one float ulp under a half (0.15 * 30) rounding up
        n = min(num_layers, max(1, math.floor(f * num_layers + 0.5 + 1e-9))) if f > 0 and num_layers else 0
        return range(num_layers - n, num_layers) if self.preset != "bf16" else range(0)

    def _base_precision(self, name: str, kind: str, layer: int | None, last: range) -> str:
        if self.preset == "bf16" or layer is None or layer in last or kind == "router":
            return "bf16"
        if self.preset == "nvfp4-experts":
            return "w4a4" if kind == "routed_experts" else "bf16"
        return "w4a16" if self.preset == "nvfp4-w4a16" else "w4a4"

    def resolve(self, model: nn.Module) -> dict[str, str]:
        """{module name: "bf16" | "w4a16" | "w4a4"} for every nn.Linear of `model`, in module order."""
        linears = [name for name, m in model.named_modules() if is_linear(m)]
        empty = {name for name, m in model.named_modules()  # a sampler's packed linears have no .weight
                 if is_linear(m) and getattr(m, "weight", None) is not None and m.weight.numel() == 0}
        layers = {i for name, _ in model.named_modules() if (i := layer_index(name)) is not None}
        num_layers = max(layers) + 1 if layers else 0
        last = self.bf16_last_layers(num_layers)
        resolved = {n: self._base_precision(n, module_kind(n), layer_index(n), last) for n in linears}
        for pattern, precision in self.rules:
            matched = [n for n in linears if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                others = [n for n, m in model.named_modules() if n and fnmatch.fnmatchcase(n, pattern)]
                hint = (f"; it matches only non-linear modules ({', '.join(others[:3])}), which always "
                        "keep their own dtype" if others else "")
                raise ValueError(f"PrecisionContract.rules: {pattern!r} -> {precision!r} matches no "
                                 f"nn.Linear in the model{hint}. Fix or remove the rule.")
            for n in matched:
                resolved[n] = precision
        for n in empty:  # zero-width (a Qwen2-MoE shared expert of width 0): no weights to quantize
            resolved[n] = "bf16"
        routers = [n for n, p in resolved.items() if p != "bf16" and module_kind(n) == "router"]
        if routers:
            raise ValueError(f"PrecisionContract: router(s) {routers[:3]} resolve to {resolved[routers[0]]}; "
                             "routers must stay BF16 (a 4-bit router changes expert choices between trainer "
                             "and sampler). Add a later rule ('*.mlp.gate', 'bf16') or narrow the glob.")
        config = getattr(model, "config", None)
        heads = [n for n, p in resolved.items() if p != "bf16" and module_kind(n) == "lm_head"]
        if heads and getattr(config, "tie_word_embeddings", False):
            raise ValueError(f"PrecisionContract: {heads[0]} resolves to {resolved[heads[0]]} but is tied to "
                             "embed_tokens (tie_word_embeddings); a checkpoint stores the tied weight once, "
                             "as the embedding, so export would refuse it after training. Keep lm_head BF16: "
                             f"drop the rule, or add a later rule ({heads[0]!r}, 'bf16')")
        if self.preset != "bf16":
            self._check_preset_applies(model, num_layers)
            if linears and all(p == "bf16" for p in resolved.values()):
                why = (f"its {num_layers} decoder layer(s) all fall in the last bf16_last_fraction="
                       f"{self.bf16_last_fraction} kept BF16" if len(last) == num_layers else
                       "the rules and the BF16-kept layers leave no linear to quantize")
                raise ValueError(f"PrecisionContract.preset={self.preset!r} quantizes nothing in this model: "
                                 f"{why}, so it would train and sample in BF16 under an NVFP4 label. Lower "
                                 "bf16_last_fraction (0 quantizes every layer), or use preset 'bf16'")
        return resolved

    def _check_preset_applies(self, model: nn.Module, num_layers: int) -> None:
        if num_layers == 0:
            raise ValueError(f"PrecisionContract.preset={self.preset!r}: the model has no decoder layers "
                             "named 'model.layers.{i}.'; name them the Hugging Face way or use rules")
        experts = {n for n, m in model.named_modules() if module_kind(n) == "routed_experts"}
        fused = [n for n, m in model.named_modules() if n in experts and not is_linear(m)
                 and any(p.dim() >= 3 for p in m.parameters(recurse=False))]
        if fused:
            raise ValueError(f"PrecisionContract.preset={self.preset!r}: routed experts at {fused[0]} are "
                             "fused 3D parameters, not nn.Linear, so they cannot be converted; load the "
                             "model with fp4rl.load_model (its experts are plain nn.Linear)")
        if self.preset == "nvfp4-experts" and not any(is_linear(m) for n, m in model.named_modules()
                                                      if n in experts):
            raise ValueError("PrecisionContract.preset='nvfp4-experts': the model has no routed experts "
                             "('.mlp.experts.{e}.*' linears); for a dense model use 'nvfp4-linear'")

    # -- summary ------------------------------------------------------------------------------
    def summary(self, model: nn.Module) -> str:
        """Parameters in NVFP4 per module kind and which decoder layers stay BF16, as text."""
        resolved = self.resolve(model)
        owner, tied = {}, []  # parameter id -> (first owning module, is a quantized linear's weight)
        for mname, module in model.named_modules(remove_duplicate=False):
            for pname, p in module.named_parameters(recurse=False):
                if id(p) not in owner:
                    owner[id(p)] = (mname, pname == "weight" and resolved.get(mname, "bf16") != "bf16")
                else:
                    tied.append(f"{mname}.{pname} is {owner[id(p)][0]}.{pname}")
        rows = {k: [0, 0, 0] for k in KINDS}  # kind -> [params, w4a4 params, w4a16 params]
        for p in model.parameters():  # each shared (tied) parameter once
            mname, quantized = owner[id(p)]
            row = rows[module_kind(mname)]
            row[0] += p.numel()
            if quantized:
                row[1 if resolved[mname] == "w4a4" else 2] += p.numel()
        layers = {i for n, _ in model.named_modules() if (i := layer_index(n)) is not None}
        num_layers = max(layers) + 1 if layers else 0
        last = self.bf16_last_layers(num_layers)
        quantized_layers = {layer_index(n) for n, p in resolved.items() if p != "bf16"}
        bf16_layers = [i for i in range(num_layers) if i not in quantized_layers]
        tile = "16x16" if self.weight_tile == (16, 16) else "1x16"

        def rule(on, err):
            return f"4/6 ({err})" if on else "max->6"

        lines = [
            f"PrecisionContract preset={self.preset!r} backward={self.backward!r} rules={list(self.rules)}",
            f"  weights: per-tensor scale, {tile} tiles, {rule(self.weight_four_over_six, self.weight_err)}; "
            f"activations (W4A4): per-token scale, 1x16, {rule(self.act_four_over_six, self.act_err)}",
            f"  {'kind':<16}{'params':>14}{'NVFP4':>14}{'W4A4':>14}{'W4A16':>14}{'NVFP4 %':>9}",
        ]
        total = [0, 0, 0]
        for kind, (n, a4, a16) in rows.items():
            if n:
                total = [total[0] + n, total[1] + a4, total[2] + a16]
                lines.append(f"  {_KIND_LABEL.get(kind, kind):<16}{n:>14,}{a4 + a16:>14,}{a4:>14,}{a16:>14,}"
                             f"{100 * (a4 + a16) / n:>8.1f}%")
        n, a4, a16 = total
        lines.append(f"  {'total':<16}{n:>14,}{a4 + a16:>14,}{a4:>14,}{a16:>14,}"
                     f"{100 * (a4 + a16) / max(n, 1):>8.1f}%")
        rule_text = "no last-layer rule (bf16 preset)" if self.preset == "bf16" else (
            f"last-layer rule keeps round({self.bf16_last_fraction:g} * {num_layers}) = {len(last)} BF16: "
            f"{_ranges(last)}")
        if tied:
            lines.append(f"  tied (counted once, under the first owner): {'; '.join(tied)}")
        lines.append(f"  decoder layers: {num_layers}; {rule_text}")
        lines.append(f"  layers with every linear BF16: {_ranges(bf16_layers)}")
        return "\n".join(lines)


def _ranges(indices) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'; [] -> 'none'."""
    spans: list[list[int]] = []
    for i in sorted(indices):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans) or "none"

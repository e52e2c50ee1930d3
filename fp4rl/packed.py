"""The sampler's weights: packed NVFP4 linears, fused input groups, and the sampler's model copy.

The sampler runs the trainer's model code (fp4rl.model) on its own copy of the weights
(`build_sampler_model`). Each linear the precision contract quantizes becomes a
`PackedNVFP4Linear` holding only the bytes the trainer's forward computed with (E2M1 codes, E4M3
block scales, FP32 global scale; no master weight) and computing what `qat.NVFP4Linear` computes:

    W4A16:  y = x @ DQ(W).T + b          W4A4:  y = DQ(Q(x)) @ DQ(W).T + b

with Q(x) the same `fp4rl.nvfp4.quantize` call (one FP32 scale per token, the contract's 4/6
settings). Everything else is a copy of the trainer's tensors in the sampler's dtype. A packed
linear takes 0.5625 byte/parameter + 4 bytes of global scale, against 2 for BF16: ~0.28x.

Dequantized cache. Dequantizing every weight on every decode step is what a fused W4A16 kernel
does in registers; in plain torch on a CPU it costs more than the matmul. So with
`cache_dequantized` (the sampler's default on the CPU, off on CUDA) a linear keeps DQ(W) per
weight version: the packed bytes stay the source of truth (weight sync writes them, the copy is
rebuilt when their version changes), at 2 (BF16) or 4 (FP32) extra bytes per quantized
parameter. A GPU kernel plugs in by overriding one method, `PackedNVFP4Linear.linear`.

Fused groups (CPU). q/k/v read the same input, and so do an MLP's gate/up. `fuse_linears` makes
each such group one GEMM on the concatenated weights, and in W4A4 one Q(x) instead of three (or
two): x is quantized by the same call either way, so the bytes are the trainer's. The model code
is unchanged: the first member called computes the whole group's output for that input tensor and
the others take their slice when called with the same tensor object. Dense members' weights
become views of one fused buffer (no extra memory; weight sync writes through the views); packed
members share one dequantized cache. It is exact only if the BLAS computes a row of x @ W.T the
same way whatever N is; tests/test_sampler.py checks fused == unfused bit for bit.

Prepacked BF16 GEMMs (CPU). `F.linear` on a BF16 CPU tensor hands oneDNN a plain [N, K] weight,
and oneDNN reorders it into its blocked (AMX / AVX-512 BF16) layout on every call: for the small
M of a decode step that reorder costs as much as the product. With `prepack` (the sampler's
default on a CPU with oneDNN BF16 support) every linear of the sampler copy computes with a copy
of its weight laid out once per weight version (`PrepackedWeight`): on an AMX CPU the tiled copy
of fp4rl.nvfp4.cpu_gemm (one sequential stream per weight; up to GEMM_MAX_ROWS rows, above which a
dense weight goes to F.linear), elsewhere oneDNN's reordered copy (bit-identical to `F.linear`).
A packed NVFP4 linear then keeps the laid-out DQ(W) instead of the plain one (no extra bytes);
a BF16 linear keeps its weight (weight sync writes it) and the copy (2x its bytes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp4rl.model import MLP, Attention, CausalLM
from fp4rl.nvfp4 import NVFP4Tensor, cpu_gemm, dequantize, quantize
from fp4rl.qat import NVFP4Linear


def onednn_bf16_available() -> bool:
    """Whether this CPU build of torch can prepack BF16 linear weights for oneDNN."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
                    and hasattr(ops, "_linear_pointwise") and ops._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PrepackedWeight:
    """One BF16 CPU weight [N, K] in a GEMM-ready layout, rebuilt when `key` changes: the AMX kernel's
    tiled copy (`cpu_gemm.BF16Weight`) where that kernel runs, else oneDNN's reordered copy."""

    def __init__(self):
        self.packed, self.key, self.nbytes = None, None, 0

    def invalidate(self) -> None:
        self.packed, self.key, self.nbytes = None, None, 0

    def linear(self, x: torch.Tensor, key, make_weight, bias: torch.Tensor | None,
               plain: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T + b with W = make_weight() laid out once per key; x [..., K] BF16 on the CPU. `plain`:
        W itself when the caller holds it (a dense weight), for prefills above GEMM_MAX_ROWS rows, where
        oneDNN's blocked GEMM on W is faster than the AMX kernel."""
        amx = cpu_gemm.available()
        if amx and plain is not None and x.numel() // max(x.shape[-1], 1) > GEMM_MAX_ROWS:
            return F.linear(x, plain, bias)
        self.get(key, make_weight, amx)
        if isinstance(self.packed, cpu_gemm.BF16Weight):
            if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
                bias = bias.to(torch.bfloat16).contiguous()
            return cpu_gemm.linear(x, self.packed, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def get(self, key, make_weight, amx: bool | None = None):
        """The laid-out weight for `key` (built from make_weight() when the key changed): a
        cpu_gemm.BF16Weight where the AMX kernel runs, else oneDNN's reordered tensor."""
        if amx is None:
            amx = cpu_gemm.available()
        if self.key != key or self.packed is None:
            weight = make_weight()
            if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
                raise ValueError(f"prepacked linear: the weight is {weight.dtype} on {weight.device}; "
                                 "prepacking is for BF16 weights on the CPU (else Sampler(prepack=False))")
            if amx and weight.dim() == 2 and weight.shape[1] % 16 == 0:
                self.packed = cpu_gemm.BF16Weight(weight)
            else:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            self.key = key
            self.nbytes = self.packed.nbytes if isinstance(self.packed, cpu_gemm.BF16Weight) else \
                weight.numel() * weight.element_size()
        return self.packed


def _prepackable(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu"


GEMM_MAX_ROWS = 64
"""Rows up to which a BF16 CPU product with NVFP4 weights runs the AMX kernel on the packed bytes
(`fp4rl.nvfp4.cpu_gemm`); above, a prefill dequantizes the weight for that call and runs oneDNN,
whose blocked GEMM is faster once the dequantization is shared by that many rows."""


class NVFP4GemmCache:
    """A linear's (or fused group's) weights in `cpu_gemm`'s layout, rebuilt when `key` changes."""

    def __init__(self):
        self.weight, self.key = None, None

    def invalidate(self) -> None:
        self.weight, self.key = None, None

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes if self.weight is not None else 0

    def get(self, key, parts) -> cpu_gemm.GemmWeight | None:
        """The kernel's copy for `key` (rebuilt from parts() when the key changed), None if unsupported."""
        if self.key != key or self.weight is None:
            qs = parts()
            self.weight = cpu_gemm.GemmWeight(qs) if all(map(cpu_gemm.supported_weight, qs)) else None
            self.key = key
        return self.weight

    def linear(self, x: torch.Tensor, key, parts, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x @ DQ(W).T + b for BF16 x on the CPU, or None when the kernel does not apply here."""
        w = self.get(key, parts)
        if w is None or not w.ok:
            return None
        if x.numel() // max(x.shape[-1], 1) > GEMM_MAX_ROWS:
            return F.linear(x, cpu_gemm.dequantize_bf16(w), bias)
        return cpu_gemm.linear(x, w, bias)


class PackedNVFP4Linear(nn.Module):
    """The sampler's side of `qat.NVFP4Linear`: packed NVFP4 weight buffers + bias, same forward.

    Buffers (under the linear's HF name): `weight_data` uint8 [N, K/2], `weight_block_scale`
    float8_e4m3fn [N, K/16], `weight_global_scale` float32 [] (decode direction).
    """

    is_linear = True  # precision.is_linear
    group: FusedGroup | None = None

    def __init__(self, qweight: NVFP4Tensor, bias: torch.Tensor | None, mode: str, input_kwargs: dict, *,
                 cache_dequantized: bool = True):
        super().__init__()
        if mode not in ("w4a16", "w4a4"):
            raise ValueError(f"PackedNVFP4Linear mode={mode!r}: use 'w4a16' or 'w4a4'")
        self.register_buffer("weight_data", qweight.data)
        self.register_buffer("weight_block_scale", qweight.block_scale)
        self.register_buffer("weight_global_scale", qweight.global_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.weight_meta = dict(shape=qweight.shape, dtype=qweight.dtype, tile=qweight.tile,
                                scale_rule=qweight.scale_rule, hadamard_seed=qweight.hadamard_seed)
        self.out_features, self.in_features = qweight.shape
        self.mode, self.input_kwargs, self.cache_dequantized = mode, dict(input_kwargs), cache_dequantized
        self._dequantized: torch.Tensor | None = None
        self._dequantized_key = None
        self.prepack = False  # set by prepack_linears: compute with a oneDNN-reordered DQ(W)
        self._prepacked = PrepackedWeight()
        self.amx = False  # set by use_nvfp4_gemm: few-row BF16 products read the packed bytes (AMX)
        self._gemm = NVFP4GemmCache()

    @classmethod
    def from_trainer(cls, m: NVFP4Linear, *, dtype: torch.dtype, device, cache_dequantized: bool):
        """A packed copy of a trainer NVFP4Linear: the bytes of its cached Q(W), its bias in `dtype`. A
        trainer on another device (host memory) without a current Q(W) is quantized on `device`, uncached
        (the same bytes): the sampler's device never holds the master weights."""
        q = m.quantized_weight(device=device)
        if q is m._qweight:  # the trainer's cache: copy it, the sampler shares nothing with the trainer
            q = NVFP4Tensor(**{**vars(q), "data": q.data.to(device, copy=True),
                               "block_scale": q.block_scale.to(device, copy=True),
                               "global_scale": q.global_scale.to(device, copy=True)})
        bias = None if m.bias is None else m.bias.detach().to(device=device, dtype=dtype, copy=True)
        return cls(q, bias, m.mode, m.input_kwargs, cache_dequantized=cache_dequantized)

    def quantized_weight(self) -> NVFP4Tensor:
        return NVFP4Tensor(data=self.weight_data, block_scale=self.weight_block_scale,
                           global_scale=self.weight_global_scale, **self.weight_meta)

    def weight_version(self) -> tuple:
        """Changes whenever the packed bytes are written (in-place copies bump `_version`; inference-mode
        tensors have no version counter, so `Sampler.load` also calls `invalidate`)."""
        b = self._buffers  # not nn.Module.__getattr__: this runs for every linear of every decode step
        d, s, g = b["weight_data"], b["weight_block_scale"], b["weight_global_scale"]
        return (_version(d), _version(s), _version(g), d.data_ptr(), s.data_ptr(), g.data_ptr())

    def invalidate(self) -> None:
        """Drop the dequantized cache (rebuilt on the next forward)."""
        self._dequantized, self._dequantized_key = None, None
        self._prepacked.invalidate()
        self._gemm.invalidate()

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """DQ(W) [N, K] in dtype; cached per weight version when cache_dequantized."""
        if not self.cache_dequantized:
            return dequantize(self.quantized_weight(), dtype)
        key = (dtype, self.weight_version())
        if self._dequantized_key != key:
            self._dequantized = dequantize(self.quantized_weight(), dtype)
            self._dequantized_key = key
        return self._dequantized

    def quantize_input(self, x: torch.Tensor) -> NVFP4Tensor:
        """Q(x) of activations [M, K], one global scale per token: the trainer's exact call."""
        return quantize(x, **self.input_kwargs)

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """DQ(Q(x)) in W4A4, x itself in W4A16."""
        if self.mode == "w4a16":
            return x
        return dequantize(self.quantize_input(x.reshape(-1, x.shape[-1])), x.dtype).reshape(x.shape)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ DQ(W).T + b, x [..., K] (already DQ(Q(x)) in W4A4). Override for a W4A16 GPU kernel."""
        if self.amx and _prepackable(x):
            y = self._gemm.linear(x, self.weight_version(), lambda: [self.quantized_weight()], self.bias)
            if y is not None:
                return y
        if self.prepack and _prepackable(x):
            return self._prepacked.linear(x, self.weight_version(),
                                          lambda: dequantize(self.quantized_weight(), x.dtype), self.bias)
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            return self.group(self, x)
        return self.linear(self.prepare_input(x))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, mode={self.mode}, cache_dequantized={self.cache_dequantized}")


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor has no version counter
        return -1


class PrepackedLinear(nn.Linear):
    """A sampler-side nn.Linear computing with its weight prepacked for oneDNN (BF16 on the CPU).

    `prepack_linears` turns plain nn.Linear modules into this class in place (same Parameters, so
    a tied lm_head stays tied and weight sync writes the same tensors); the reordered copy is
    rebuilt when the weight's storage or version changes, or on `invalidate()`.
    """

    _prepacked: PrepackedWeight

    def invalidate(self) -> None:
        self._prepacked.invalidate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _prepackable(x) or self.weight.dtype != torch.bfloat16:
            return F.linear(x, self.weight, self.bias)
        w = self.weight
        return self._prepacked.linear(x, (w.data_ptr(), _version(w)), lambda: w.detach(), self.bias, plain=w)


class GroupedLinear(nn.Linear):
    """An unquantized member of a FusedGroup: its weight and bias are views of the group's buffers."""

    group: FusedGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group(self, x) if self.group is not None else super().forward(x)


class FusedGroup:
    """Linears reading the same input, computed as one GEMM (see the module docstring)."""

    def __init__(self, members: list[nn.Module]):
        self.members = members
        self.splits = [m.out_features for m in members]
        self.packed = isinstance(members[0], PackedNVFP4Linear)
        self._x, self._outs = None, {}
        self._weight, self._weight_key = None, None
        self.prepack = False  # set by prepack_linears
        self._prepacked = PrepackedWeight()
        self.amx = False  # set by use_nvfp4_gemm (packed members only)
        self._gemm = NVFP4GemmCache()
        if not self.packed:  # one buffer, members' Parameters become views of it
            self._weight = torch.cat([m.weight.detach() for m in members])  # [sum N, K]
            self._bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
            start = 0
            for m, n in zip(members, self.splits):
                m.weight = nn.Parameter(self._weight[start:start + n], requires_grad=False)
                if self._bias is not None:
                    m.bias = nn.Parameter(self._bias[start:start + n], requires_grad=False)
                start += n
        for m in members:
            m.group = self

    def invalidate(self) -> None:
        self._prepacked.invalidate()
        self._gemm.invalidate()
        self._bias_stack = None
        if self.packed:
            self._weight, self._weight_key = None, None

    @property
    def nbytes(self) -> int:
        """Extra bytes the group holds (the packed members' dequantized weight, the reordered copy)."""
        dequantized = self._weight.nbytes if self.packed and self._weight is not None else 0
        return dequantized + self._prepacked.nbytes + self._gemm.nbytes

    def weight_and_bias(self, dtype: torch.dtype):
        if not self.packed:
            return self._weight, self._bias
        bias = self._stacked_bias()
        if not self.members[0].cache_dequantized:
            return torch.cat([m.dequantized_weight(dtype) for m in self.members]), bias
        key = (dtype, self._versions())
        if self._weight_key != key:
            self._weight = self._dequantized_stack(dtype)
            self._weight_key = key
        return self._weight, bias

    def _versions(self) -> tuple:
        return tuple(m.weight_version() for m in self.members)

    def _stacked_bias(self) -> torch.Tensor | None:
        """The packed members' biases as one vector (None without biases), kept while the members' bias
        tensors are the same and unwritten (weight sync writes them in place: their versions move)."""
        if self.members[0].bias is None:
            return None
        key = tuple((id(m.bias), m.bias.data_ptr(), _version(m.bias)) for m in self.members)
        cached = self.__dict__.get("_bias_stack")
        if cached is None or cached[0] != key or -1 in (k[2] for k in key):
            cached = self._bias_stack = (key, torch.cat([m.bias for m in self.members]))
        return cached[1]

    def _quantized_parts(self) -> list[NVFP4Tensor]:
        return [m.quantized_weight() for m in self.members]

    def _dequantized_stack(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([dequantize(m.quantized_weight(), dtype) for m in self.members])

    def _prepacked_linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return self._prepacked.linear(x, self._versions(), lambda: self._dequantized_stack(x.dtype),
                                          self._stacked_bias())
        key = (self._weight.data_ptr(), _version(self._weight))
        return self._prepacked.linear(x, key, lambda: self._weight, self._bias, plain=self._weight)

    def __call__(self, member: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x is not self._x or id(member) not in self._outs:
            x_in = self.members[0].prepare_input(x) if self.packed else x
            y = None
            if self.amx and _prepackable(x_in):
                y = self._gemm.linear(x_in, self._versions(), self._quantized_parts, self._stacked_bias())
            if y is None and self.prepack and _prepackable(x_in):
                y = self._prepacked_linear(x_in)
            elif y is None:
                weight, bias = self.weight_and_bias(x_in.dtype)
                y = F.linear(x_in, weight, bias)  # [..., sum N]
            self._x, self._outs = x, {id(m): part for m, part in zip(self.members, y.split(self.splits, -1))}
        out = self._outs.pop(id(member))
        if not self._outs:
            self._x = None  # every member took its slice: hold nothing between calls
        return out


def _fusable(members: list[nn.Module]) -> bool:
    first = members[0]
    if any((m.bias is None) != (first.bias is None) for m in members):
        return False
    if all(type(m) is nn.Linear for m in members):
        return len({(m.weight.dtype, m.weight.device) for m in members}) == 1
    if all(isinstance(m, PackedNVFP4Linear) for m in members):
        return all(m.mode == first.mode and m.input_kwargs == first.input_kwargs
                   and m.cache_dequantized == first.cache_dequantized for m in members)
    return False  # mixed precisions in one group (a rule quantizes q_proj only): leave them apart


def fuse_linears(model: nn.Module) -> list[FusedGroup]:
    """Fuse q/k/v of every Attention and gate/up of every MLP (experts included) where possible."""
    groups = []
    # the parents only: a list of every module would keep each replaced nn.Linear, and with it its unfused
    # weight, alive beside the fused buffer until the end (a 30B's BF16 experts: +36 GiB at the peak)
    for module in [m for m in model.modules() if isinstance(m, Attention | MLP)]:
        names = ("q_proj", "k_proj", "v_proj") if isinstance(module, Attention) else ("gate_proj", "up_proj")
        members = [getattr(module, n) for n in names]
        if not _fusable(members):
            continue
        if type(members[0]) is nn.Linear:
            dense = []
            for name, m in zip(names, members):
                g = GroupedLinear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
                g.weight, g.bias = m.weight, m.bias
                setattr(module, name, g)
                dense.append(g)
            members = dense
        groups.append(FusedGroup(members))
    return groups


def gemm_site(m) -> tuple | None:
    """(weight, bias) of a sampler linear or fused group as the AMX kernel reads it (a cpu_gemm.GemmWeight
    or BF16Weight, refreshed for the current weight version), for a caller that runs the GEMM itself
    (cpu_ops' whole-step decode); None where that linear does not run the kernel on BF16 inputs (W4A4
    inputs, no AMX, no fast path enabled)."""
    if not cpu_gemm.available():
        return None
    if isinstance(m, FusedGroup):
        if m.packed:
            if m.members[0].mode != "w4a16":
                return None
            if m.amx:
                w = m._gemm.get(m._versions(), m._quantized_parts)
            elif m.prepack:
                w = m._prepacked.get(m._versions(), lambda: m._dequantized_stack(torch.bfloat16))
            else:
                return None
            bias = m._stacked_bias()
        elif m.prepack:
            w = m._prepacked.get((m._weight.data_ptr(), _version(m._weight)), lambda: m._weight)
            bias = m._bias
        else:
            return None
    elif isinstance(m, PackedNVFP4Linear):
        if m.mode != "w4a16" or m.group is not None:
            return None
        if m.amx:
            w = m._gemm.get(m.weight_version(), lambda: [m.quantized_weight()])
        elif m.prepack:
            w = m._prepacked.get(m.weight_version(), lambda: dequantize(m.quantized_weight(), torch.bfloat16))
        else:
            return None
        bias = m.bias
    elif isinstance(m, PrepackedLinear) and m.weight.dtype == torch.bfloat16:
        w = m._prepacked.get((m.weight.data_ptr(), _version(m.weight)), lambda: m.weight.detach())
        bias = m.bias
    else:
        return None
    if not isinstance(w, cpu_gemm.GemmWeight | cpu_gemm.BF16Weight) or not w.ok:
        return None
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.dim() != 1 or not bias.is_contiguous()):
        return None
    return w, bias


def prepack_linears(model: nn.Module) -> int:
    """Make every linear of the sampler copy compute with a oneDNN-prepacked BF16 weight on the CPU
    (plain nn.Linear modules become PrepackedLinear in place). Returns how many linears it covers."""
    count = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = PrepackedLinear
            m._prepacked = PrepackedWeight()
        elif isinstance(m, PackedNVFP4Linear):
            m.prepack = True
        elif not isinstance(m, GroupedLinear):  # a fused member: its group computes it
            continue
        count += 1
    for group in getattr(model, "fused_groups", []):
        group.prepack = True
    return count


def use_nvfp4_gemm(model: nn.Module) -> int:
    """Make the sampler copy's NVFP4 linears (and fused groups of them) run `fp4rl.nvfp4.cpu_gemm`
    for BF16 inputs of up to GEMM_MAX_ROWS rows. Returns how many modules and groups it covers."""
    count = 0
    for m in model.modules():
        if isinstance(m, PackedNVFP4Linear):
            m.amx, m.cache_dequantized = True, False
            count += 1
    for group in getattr(model, "fused_groups", []):
        if group.packed:
            group.amx = True
    return count


def _inside(key: str, modules) -> bool:
    """Whether the state-dict key belongs to one of `modules` (names) or to a submodule of one: a lookup per
    ancestor of the key (a prefix test against every name was quadratic: ~100 s for Qwen3-30B-A3B's 18432
    expert linears)."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in modules for i in range(1, len(parts)))


def build_sampler_model(model: CausalLM, *, dtype: torch.dtype, device, cache_dequantized: bool,
                        fuse: bool, prepack: bool = False, nvfp4_gemm: bool = False,
                        cpu_ops: bool = False) -> CausalLM:
    """The sampler's own copy of a (converted) trainer CausalLM: PackedNVFP4Linear for each
    NVFP4Linear, copies of every other tensor in `dtype` on `device`. Shares nothing with `model`."""
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    with torch.device("meta"):
        copy = CausalLM(model.config)
    for name, m in quantized.items():
        parent, _, child = name.rpartition(".")
        packed = PackedNVFP4Linear.from_trainer(m, dtype=dtype, device=device,
                                                cache_dequantized=cache_dequantized)
        setattr(copy.get_submodule(parent) if parent else copy, child, packed)
    skip = {f"{name}.{p}" for name in quantized for p in ("weight", "bias")}
    if model.config.tie_word_embeddings:
        skip.add("lm_head.weight")
    state = {k: v.detach().to(device=device, dtype=dtype, copy=True)
             for k, v in model.state_dict().items() if k not in skip}
    missing, unexpected = copy.load_state_dict(state, strict=False, assign=True)
    del state  # the model holds them now: fusing frees each group's unfused tensors as it goes
    missing = [k for k in missing if k not in skip and not _inside(k, quantized)]
    if missing or unexpected:
        raise ValueError(f"Sampler: the trainer model's tensors do not match a {model.config.model_type} "
                         f"CausalLM (missing {missing[:5]}, unexpected {unexpected[:5]}); pass an fp4rl "
                         "CausalLM converted with qat.convert")
    copy.tie_weights()
    for p in copy.parameters():
        p.requires_grad_(False)
    copy.fused_groups = fuse_linears(copy) if fuse else []
    if prepack:
        if not onednn_bf16_available():
            raise ValueError("prepack=True needs torch's oneDNN with BF16 support on this CPU; "
                             "pass prepack=False")
        prepack_linears(copy)
    if nvfp4_gemm:
        if not cpu_gemm.available():  # else the first forward raises inside cpu_gemm.linear
            raise ValueError("nvfp4_gemm=True needs fp4rl.nvfp4.cpu_gemm, the AMX-BF16 NVFP4 GEMM, which "
                             "is not available on this CPU (cpu_gemm.available() is False); pass "
                             "nvfp4_gemm=False")
        use_nvfp4_gemm(copy)
    if cpu_ops:  # fused non-GEMM decoder kernels (fp4rl/cpu_ops.py); where they cannot build: unchanged
        from fp4rl.cpu_ops import fast_cpu_ops

        fast_cpu_ops(copy)
    return copy.eval()

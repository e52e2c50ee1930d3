"""The sampler on a GPU: Triton NVFP4 kernels in its modules, a static KV cache, CUDA graphs for decode.

`Sampler(..., kernels=True)` (the default on CUDA in bfloat16) builds a `DecodeEngine` over the
sampler's own model copy. What it changes, and what it computes:

- Packed NVFP4 linears (`KernelPackedLinear`): W4A16 runs `fp4rl.kernels.gemm`, y = (sum_k x_k *
  (e2m1 * s)_k) * g_w with an FP32 accumulator, the weight dequantized in registers. W4A4 first
  quantizes x per token with `fp4rl.kernels.quantize` (byte-identical to the trainer's
  `fp4rl.nvfp4.quantize` with the contract's activation settings, so Q(x) is the trainer's), then
  runs the exact-operand block-scaled product (e2m1 s)_x (e2m1 s)_w * g_x * g_w that an FP4 MMA
  computes. Against the CPU path (DQ(Q(x)) @ DQ(W).T on operands rounded to bfloat16) both differ
  by bfloat16 rounding only; rows of x never interact, so the result does not depend on the batch.
  Above `gemm.DECODE_MAX_ROWS` rows (prefill) an untuned engine uses the kernels' dequantize-then-
  cuBLAS path (measured best at 512 rows, bench/RESULTS.md).
- Fused q/k/v and gate/up (`KernelFusedGroup`): the members' packed bytes become views of one
  [sum N, K/2] buffer (weight sync writes through them), one kernel call per group, one Q(x) in
  W4A4; the members' global scales are copied into a per-row vector at every `generate`.
- Routed experts (`KernelMoeBlock.run_experts`): the (token, expert) pairs are sorted by expert
  on the device (no host sync), gate/up and down of all experts run as two grouped GEMMs over
  [E, N, K/2] stacks (`gemm.grouped_linear`, or W4A4 on one Q(x) per row); BF16 experts use
  `torch._grouped_mm` on [E, N, K] stacks. The k expert outputs of a token are weighted and
  summed in FP32 (the CPU loop adds them in bfloat16, expert by expert).
- BF16 weights (lm_head, embeddings, BF16 layers) stay on cuBLAS.
- KV cache: one static cache (`fp4rl.kvcache` classes, B_cap rows x T_cap slots) reused across
  `generate` calls; prefill writes it through prefix views, the n-fold copy of a prompt's rows and
  the compaction of finished rows are done in place. A decode step writes its token's K/V at one
  slot (NVFP4: `kernels.quantize` per (row, head), byte-identical to the CPU cache's quantizer; FP8:
  the cache's own torch quantizer) and attends with `kernels.attention.decode_attention` over
  [first real token, slot] of each row (left padding skipped); the BF16 cache uses SDPA over all
  T_cap slots with a mask.
- Fused decode step (`FUSED`, `DecodeEngine(fused=...)`, `set_fused` for A/B): the elementwise work between
  the GEMMs runs as fp4rl.kernels.fused kernels, four per layer plus one for the final norm: residual add +
  RMSNorm before attention and before the MLP, q/k-norm + RoPE + the write of k/v into the BF16 cache slot
  (FP8/NVFP4 caches keep `store_kv`), SiLU(gate) * up. Where the consumer is a W4A4 linear or fused group
  (q/k/v, gate/up, down_proj), the producer kernel also quantizes its output per token with the shared
  quantizer's own helpers (the bytes of `kernels.quantize` for the same input) and the GEMM takes that Q(x)
  (`packed_gemm(..., xq=)`, `gemm.gemm`'s pre-quantized entry); o_proj (after SDPA) still quantizes its
  input itself. Same arithmetic as the modules, bit for bit except the norms' rstd (fp32 sum of squares
  added in another order, Triton's rsqrt: y can move by one bfloat16 ulp, see fused.py). `fused_plans`
  decides per layer: q/k/v that are not one fused group, MoE and unfused MLPs run their modules on the
  norm's bf16 output (a layer that falls back launches fewer fused kernels).
- CUDA graphs: one graph per batch bucket (powers of two up to B_cap), captured on first use
  after an eager warm-up step on a side stream (Triton compiles and the GEMM tuner runs there,
  never during capture), replayed for every decode step of that bucket. Inputs (tokens, RoPE
  positions, first real slot per row, current length) are copied into static buffers; rows past
  the live batch in a bucket compute on stale data nobody reads. The step has no host sync
  (quantize with check_finite=False, routing sorted on the device). If capture fails the engine
  warns once, records why (`graph_error`) and decodes eagerly with the same code (until `set_fused`
  switches the step, which then gets its own capture).
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from fp4rl.kvcache import _write, make_kv_cache
from fp4rl.model import MLP, CausalLM, ModelConfig, rotate_half
from fp4rl.moe import SparseMoeBlock
from fp4rl.packed import FusedGroup, PackedNVFP4Linear

KERNEL_DTYPE = torch.bfloat16
TUNE = True  # time the GEMM candidates per shape on first use (gemm.tune); False: first candidate, no timing
# Keep a decode copy of each dense W4A16 weight for the 1-16 row kernels: on Hopper with NVRTC the CUDA
# mma16 kernel's copy (fp4rl.kernels.gemv_cuda: 1.4-2.5x cuBLAS BF16 at 1-8 rows on the H200, +0.625 byte
# per weight of device memory), else the codes in the gemv32 layout (fp4rl.kernels.gemv.swizzle) for the
# 1-4 row Gluon GEMV (+0.5 byte per weight). Rebuilt in place when the packed bytes change.
GEMV32 = True  # any decode copy at all
MMA16 = os.environ.get("FP4RL_MMA16", "1") != "0"  # the CUDA mma16 copy where it runs (else gemv32)
SLOT_ALIGN = 64  # T_cap is rounded up to this
FUSED = True  # new engines run the fused decode step (fp4rl.kernels.fused); DecodeEngine.set_fused for A/B


def _pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# ----------------------------------------------------------------------------------------------
# GEMMs


def packed_gemm(x2: torch.Tensor | None, weight, mode: str, input_kwargs: dict, offsets=None,
                xq=None) -> torch.Tensor:
    """x2 [M, K] bfloat16 @ DQ(weight).T (weight: .data/.block_scale/.global_scale), W4A16 or W4A4
    (x quantized per token with the contract's settings first, or xq: that Q(x) already made by a fused
    producer, (data, block_scale, global_scale [M])); offsets: grouped experts."""
    from fp4rl.kernels import gemm

    if xq is not None and mode != "w4a4":
        raise ValueError(f"packed_gemm: xq (a pre-quantized activation) is for W4A4 only, got mode {mode!r}; "
                         "pass x2 (the fused step's plan gives W4A16 sites no quantizer)")
    if x2 is None and xq is None:
        raise ValueError("packed_gemm: pass x2 [M, K] (or, W4A4, its Q(x) as xq)")
    config = None
    m = x2.shape[0] if xq is None else xq[0].shape[0]
    if not TUNE and offsets is None and m > gemm.DECODE_MAX_ROWS:
        config = gemm.FALLBACK
    if mode == "w4a16":
        return gemm.gemm(x2, weight, offsets=offsets, tune=TUNE, config=config)
    if xq is None:
        xq = gemm.quantize_activations(x2, scale_rule=input_kwargs["scale_rule"], err=input_kwargs["err"])
    return gemm.gemm(None, weight, xq=xq, offsets=offsets, tune=TUNE, config=config)


class _DecodeCopy:
    """The decode copy of some packed bytes for the 1-16 row kernels: the CUDA mma16 kernel's copy
    (fp4rl.kernels.gemv_cuda, bytes and block scales re-laid out) where that kernel runs, else the Gluon
    GEMV's gemv32 copy. Rebuilt in place when the bytes' version or storage changes (or after
    invalidate()); never inside a CUDA-graph capture (the engine refreshes before capturing)."""

    def __init__(self):
        self.copy, self.key = None, None
        self.mma16 = None

    def get(self, src: torch.Tensor, scale: torch.Tensor | None = None, mma16_only: bool = False):
        """The copy for these bytes (None where no decode kernel runs; mma16_only: W4A4, which only the
        mma16 kernel serves)."""
        if not GEMV32 or src.device.type != "cuda":
            return None
        from fp4rl.kernels import gemv, gemv_cuda

        if scale is not None and MMA16 and gemv_cuda.available(src.device):
            if self.mma16 is None:
                self.mma16 = gemv_cuda.Mma16Cache()
            copy = self.mma16.get(src, scale)
            if copy is not None:
                return copy
        if mma16_only:
            return None

        if not gemv.available() or src.shape[-1] % 4:
            return None
        key = (_version(src), src.data_ptr(), tuple(src.shape))
        if self.copy is None or key != self.key:
            if torch.cuda.is_current_stream_capturing():
                return None
            self.copy = gemv.swizzle(src, out=self.copy if self.copy is not None
                                     and self.copy.shape == src.shape else None)
            self.key = key
        return self.copy

    def invalidate(self) -> None:
        self.key = None  # the copy's storage is reused by the next get()
        if self.mma16 is not None:
            self.mma16.invalidate()

    @property
    def nbytes(self) -> int:
        own = 0 if self.copy is None else self.copy.nbytes
        return own + (0 if self.mma16 is None else self.mma16.nbytes)


def decode_copy_bytes(model: nn.Module) -> int:
    """Device bytes of every decode copy (mma16 or gemv32) that the kernel linears and groups hold."""
    owners = list(model.modules()) + list(getattr(model, "fused_groups", []))
    return sum(o._gemv32.nbytes for o in owners if getattr(o, "_gemv32", None) is not None)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors: Sampler.load calls invalidate() instead
        return -1


def _with_copy(weight, copy):
    if copy is None:
        return weight
    kind = "gemv32" if isinstance(copy, torch.Tensor) else "mma16"
    return SimpleNamespace(data=weight.data, block_scale=weight.block_scale, global_scale=weight.global_scale,
                           **{kind: copy})


def _decode_copy(cache: _DecodeCopy, data, scale, mode: str, x2, xq=None):
    """The decode copy for a call of `rows` rows, or None: W4A16 up to gemm.MMA16_MAX_ROWS rows where the
    mma16 kernel runs (else up to 4, Gluon gemv32); W4A4 only on the mma16 kernel."""
    from fp4rl.kernels import gemm, gemv_cuda

    rows = x2.numel() // x2.shape[-1] if x2 is not None else xq[0].shape[0]
    mma = MMA16 and gemv_cuda.available(data.device)
    limit = gemm.MMA16_MAX_ROWS if mma else 4 if mode == "w4a16" else 0
    return cache.get(data, scale, mma16_only=mode != "w4a16") if rows <= limit else None


def kernel_ready(m: nn.Module) -> bool:
    """Whether the kernels compute this packed linear: no Hadamard, K unpadded and a multiple of 16,
    and (W4A4) the contract's activation quantizer is 1x16 blocks with a per-token scale."""
    if not isinstance(m, PackedNVFP4Linear):
        return False
    kw = m.input_kwargs
    return (m.weight_meta["hadamard_seed"] is None and m.in_features % 16 == 0
            and m.weight_data.shape[-1] * 2 == m.in_features
            and (m.mode == "w4a16" or (kw.get("tile", 16) in (16, (1, 16)) and kw.get("scale_scope") == "row"
                                       and kw.get("rounding", "nearest") == "nearest"
                                       and kw.get("hadamard_seed") is None)))


class KernelPackedLinear(PackedNVFP4Linear):
    """PackedNVFP4Linear computed by the Triton kernels (same buffers; swapped in by class)."""

    _gemv32 = None

    def refresh(self) -> None:
        """Rebuild the decode copy if the packed bytes changed (called before graph capture/replay)."""
        self._swz().get(self.weight_data, self.weight_block_scale, mma16_only=self.mode != "w4a16")

    def invalidate(self) -> None:
        super().invalidate()
        if self._gemv32 is not None:
            self._gemv32.invalidate()

    def _swz(self) -> _DecodeCopy:
        if self._gemv32 is None:
            self._gemv32 = _DecodeCopy()
        return self._gemv32

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ DQ(W).T + b with the W4A16 kernel (x as given)."""
        if x.dtype != KERNEL_DTYPE:
            return super().linear(x)
        w = _with_copy(self.quantized_weight(),
                       _decode_copy(self._swz(), self.weight_data, self.weight_block_scale, "w4a16", x))
        y = packed_gemm(x.reshape(-1, x.shape[-1]), w, "w4a16", self.input_kwargs)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            return self.group(self, x)
        if self.mode == "w4a16" or x.dtype != KERNEL_DTYPE:
            return self.linear(self.prepare_input(x))
        y = self.run(x.reshape(-1, x.shape[-1]))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def run(self, x2: torch.Tensor | None, xq=None) -> torch.Tensor:
        """y [M, N] for x2 [M, K] bfloat16, or (W4A4) for its Q(x) made by a fused producer."""
        if self.mode == "w4a16":
            return self.linear(x2)
        w = _with_copy(self.quantized_weight(),
                       _decode_copy(self._swz(), self.weight_data, self.weight_block_scale, "w4a4", x2, xq))
        y = packed_gemm(x2, w, "w4a4", self.input_kwargs, xq=xq)
        return y if self.bias is None else y + self.bias


class KernelFusedGroup(FusedGroup):
    """A FusedGroup of packed linears computed as one kernel call on a stacked weight."""

    def attach(self) -> None:
        ms = self.members
        self.data = torch.cat([m.weight_data for m in ms])  # [sum N, K/2]
        self.scale = torch.cat([m.weight_block_scale for m in ms])  # [sum N, K/16]
        self.bias_cat = None if ms[0].bias is None else torch.cat([m.bias.detach() for m in ms])
        start = 0
        for m, n in zip(ms, self.splits):  # the members' bytes become views of the stack
            m.weight_data = self.data[start:start + n]
            m.weight_block_scale = self.scale[start:start + n]
            if self.bias_cat is not None:
                m.bias = nn.Parameter(self.bias_cat[start:start + n], requires_grad=False)
            start += n
        self.g_rows = torch.empty(start, dtype=torch.float32, device=self.data.device)
        self.refresh()

    def refresh(self) -> None:
        """Copy the members' global scales into the per-row vector (after a weight sync), and rebuild
        the decode copy if the packed bytes changed."""
        self.g_rows.copy_(torch.cat([m.weight_global_scale.float().reshape(1).expand(n)
                                     for m, n in zip(self.members, self.splits)]))
        self._swz().get(self.data, self.scale, mma16_only=self.members[0].mode != "w4a16")

    def invalidate(self) -> None:
        super().invalidate()
        if getattr(self, "_gemv32", None) is not None:
            self._gemv32.invalidate()

    def _swz(self) -> _DecodeCopy:
        if getattr(self, "_gemv32", None) is None:
            self._gemv32 = _DecodeCopy()
        return self._gemv32

    def run(self, x2: torch.Tensor | None, xq=None) -> torch.Tensor:
        """The whole group's y [M, sum N] for x2 [M, K] bfloat16, or (W4A4) for its Q(x) made by a fused
        producer (then x2 may be None)."""
        m0 = self.members[0]
        w = SimpleNamespace(data=self.data, block_scale=self.scale, global_scale=self.g_rows)
        w = _with_copy(w, _decode_copy(self._swz(), self.data, self.scale, m0.mode, x2, xq))
        y = packed_gemm(x2, w, m0.mode, m0.input_kwargs, xq=xq)
        return y if self.bias_cat is None else y + self.bias_cat

    def __call__(self, member: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != KERNEL_DTYPE:
            return super().__call__(member, x)
        if x is not self._x or id(member) not in self._outs:
            y = self.run(x.reshape(-1, x.shape[-1]))
            y = y.reshape(*x.shape[:-1], y.shape[-1])
            self._x, self._outs = x, {id(m): part for m, part in zip(self.members, y.split(self.splits, -1))}
        out = self._outs.pop(id(member))
        if not self._outs:
            self._x = None
        return out


# ----------------------------------------------------------------------------------------------
# Routed experts


class _PackedExperts:
    """gate/up and down of all experts as [E, 2I, K/2] and [E, H, I/2] stacks (members are views)."""

    def __init__(self, experts):
        gates, ups, downs = ([getattr(e, n) for e in experts] for n in ("gate_proj", "up_proj", "down_proj"))
        self.mode, self.input_kwargs = gates[0].mode, gates[0].input_kwargs
        self.gates, self.ups, self.downs = gates, ups, downs
        i = gates[0].out_features
        self.gu_data = torch.stack([torch.cat([g.weight_data, u.weight_data]) for g, u in zip(gates, ups)])
        self.gu_scale = torch.stack([torch.cat([g.weight_block_scale, u.weight_block_scale])
                                     for g, u in zip(gates, ups)])
        self.d_data = torch.stack([d.weight_data for d in downs])
        self.d_scale = torch.stack([d.weight_block_scale for d in downs])
        for e, (g, u, d) in enumerate(zip(gates, ups, downs)):
            g.weight_data, u.weight_data = self.gu_data[e, :i], self.gu_data[e, i:]
            g.weight_block_scale, u.weight_block_scale = self.gu_scale[e, :i], self.gu_scale[e, i:]
            d.weight_data, d.weight_block_scale = self.d_data[e], self.d_scale[e]
        dev = self.gu_data.device
        self.gu_g = torch.empty(len(gates), 2 * i, dtype=torch.float32, device=dev)  # per output row
        self.d_g = torch.empty(len(gates), dtype=torch.float32, device=dev)  # per expert
        self.refresh()

    def refresh(self) -> None:
        e, i = self.gu_g.shape[0], self.gu_g.shape[1] // 2
        g = torch.stack([m.weight_global_scale.float().reshape(()) for m in self.gates])
        u = torch.stack([m.weight_global_scale.float().reshape(()) for m in self.ups])
        self.gu_g.copy_(torch.cat([g[:, None].expand(e, i), u[:, None].expand(e, i)], 1))
        self.d_g.copy_(torch.stack([m.weight_global_scale.float().reshape(()) for m in self.downs]))

    def gate_up(self, xs, offsets):
        w = SimpleNamespace(data=self.gu_data, block_scale=self.gu_scale, global_scale=self.gu_g)
        return packed_gemm(xs, w, self.mode, self.input_kwargs, offsets)

    def down(self, a, offsets):
        w = SimpleNamespace(data=self.d_data, block_scale=self.d_scale, global_scale=self.d_g)
        return packed_gemm(a, w, self.mode, self.input_kwargs, offsets)


class _DenseExperts:
    """BF16 experts as [E, 2I, H] and [E, H, I] stacks (members' weights are views) for _grouped_mm."""

    def __init__(self, experts):
        gates, ups, downs = ([getattr(e, n) for e in experts] for n in ("gate_proj", "up_proj", "down_proj"))
        i = gates[0].out_features
        self.gu = torch.stack([torch.cat([g.weight.detach(), u.weight.detach()]) for g, u in zip(gates, ups)])
        self.d = torch.stack([d.weight.detach() for d in downs])
        for e, (g, u, d) in enumerate(zip(gates, ups, downs)):
            g.weight = nn.Parameter(self.gu[e, :i], requires_grad=False)
            u.weight = nn.Parameter(self.gu[e, i:], requires_grad=False)
            d.weight = nn.Parameter(self.d[e], requires_grad=False)
            group = getattr(g, "group", None)
            if group is not None and not group.packed:  # a dense FusedGroup: its buffer is this view too
                group._weight = self.gu[e]
        self.gu_t, self.d_t = self.gu.transpose(1, 2), self.d.transpose(1, 2)  # [E, K, N] views

    def refresh(self) -> None:
        pass

    def gate_up(self, xs, offsets):
        return torch._grouped_mm(xs, self.gu_t, offs=offsets[1:])

    def down(self, a, offsets):
        return torch._grouped_mm(a, self.d_t, offs=offsets[1:])


def _uniform(linears, test) -> bool:
    return all(test(m) for m in linears)


def expert_plan(block: SparseMoeBlock):
    """A grouped-GEMM plan for the block's experts, or None (the default loop stays)."""
    experts = list(block.experts)
    if not experts or not all(hasattr(e, "down_proj") for e in experts):
        return None
    linears = [getattr(e, n) for e in experts for n in ("gate_proj", "up_proj", "down_proj")]
    first = linears[0]
    if _uniform(linears, lambda m: kernel_ready(m) and m.bias is None and m.mode == first.mode
                and m.input_kwargs == first.input_kwargs):
        return _PackedExperts(experts)
    if _uniform(linears, lambda m: isinstance(m, nn.Linear) and m.bias is None
                and m.weight.dtype == KERNEL_DTYPE and m.weight.device == first.weight.device):
        try:  # probe: not every build / device has it
            x = torch.zeros(2, first.in_features, dtype=KERNEL_DTYPE, device=first.weight.device)
            w = torch.zeros(2, first.in_features, 16, dtype=KERNEL_DTYPE, device=first.weight.device)
            torch._grouped_mm(x, w, offs=torch.tensor([1, 2], dtype=torch.int32, device=x.device))
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"torch._grouped_mm is unavailable here ({str(exc)[:120]}); BF16 experts run one "
                          "by one (with a host sync, so no CUDA graph)", stacklevel=3)
            return None
        return _DenseExperts(experts)
    return None


class KernelMoeBlock(SparseMoeBlock):
    """SparseMoeBlock whose routed experts run as grouped GEMMs (`plan`), with no host sync."""

    plan = None

    def run_experts(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        if self.plan is None or x.dtype != KERNEL_DTYPE:
            return super().run_experts(x, topk_idx, topk_weight)
        n, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        ids = torch.arange(self.num_experts + 1, device=x.device)
        offsets = torch.searchsorted(flat[order], ids).to(torch.int32)  # [E + 1] start of each expert
        xs = x.index_select(0, order // k)  # [n k, H]
        gu = self.plan.gate_up(xs, offsets)  # [n k, 2I]
        i = gu.shape[-1] // 2
        d = self.plan.down(F.silu(gu[:, :i]) * gu[:, i:], offsets)  # [n k, H]
        out = torch.empty_like(d).index_copy_(0, order, d).view(n, k, -1)  # back to (token, slot) order
        return (out.float() * topk_weight.float()[..., None]).sum(1).to(x.dtype)


def attach_kernels(model: CausalLM) -> list:
    """Swap the sampler model's packed linears, fused packed groups and MoE blocks to the kernel
    versions (in place). Returns the objects whose derived global scales `refresh()` renews."""
    refresh = []
    expert_linears = set()
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.__class__ = KernelMoeBlock
            module.plan = expert_plan(module)
            if module.plan is not None:
                refresh.append(module.plan)
            expert_linears.update(id(m) for e in module.experts for m in e.modules())
    for group in getattr(model, "fused_groups", []):
        if group.packed and all(kernel_ready(m) for m in group.members) \
                and not any(id(m) in expert_linears for m in group.members):
            group.__class__ = KernelFusedGroup
            group.attach()
            refresh.append(group)
    for module in model.modules():
        if kernel_ready(module):
            module.__class__ = KernelPackedLinear
            if module.group is None and id(module) not in expert_linears:
                refresh.append(module)
    return refresh


# ----------------------------------------------------------------------------------------------
# The fused step's plan: which linears take a fused producer's output


class _Site:
    """A linear or fused group as the fused step calls it: run(x2 [M, K] bf16, xq=None) -> y [M, N]; quant:
    the activation quantizer's settings when it takes a Q(x) made by the producer (W4A4), else None."""

    def __init__(self, run, quant: dict | None = None):
        self.run, self.quant = run, quant


def _quant_of(m: PackedNVFP4Linear) -> dict | None:
    kw = m.input_kwargs
    return dict(scale_rule=kw["scale_rule"], err=kw["err"]) if m.mode == "w4a4" else None


def _dense_group_run(group: FusedGroup):
    return lambda x2, xq=None: F.linear(x2, group._weight, group._bias)


def _module_run(m: nn.Module):
    return lambda x2, xq=None: m(x2)


def linear_site(mods: list) -> _Site | None:
    """The site computing mods (one module, or the members of one fused group, in order), or None where
    the fused step cannot call it on a [M, K] input (then the layer runs its modules)."""
    group = getattr(mods[0], "group", None)
    if len(mods) > 1:
        if group is None or list(group.members) != list(mods):
            return None
        if isinstance(group, KernelFusedGroup):
            return _Site(group.run, _quant_of(group.members[0]))
        if not group.packed and group._weight is not None and group._weight.dtype == KERNEL_DTYPE:
            return _Site(_dense_group_run(group))
        return None
    m = mods[0]
    if group is not None:
        return None
    if isinstance(m, KernelPackedLinear):
        return _Site(m.run, _quant_of(m))
    return _Site(_module_run(m))


def fused_plans(model: CausalLM) -> list | None:
    """Per decoder layer: the q/k/v site (None: the layer's attention runs its modules), the gate/up and
    down sites of a dense MLP (None: MoE or unfused), and which norm outputs are quantized for their
    consumer. None when the fused kernels do not cover the model at all (norm weights not bf16)."""
    m = model.model
    norms = [m.norm] + [n for layer in m.layers
                        for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(n.weight.dtype != KERNEL_DTYPE for n in norms):
        return None
    plans = []
    for layer in m.layers:
        attn, mlp = layer.self_attn, layer.mlp
        p = SimpleNamespace(qkv=None, gate_up=None, down=None, in_quant=None, post_quant=None)
        qk_ok = not hasattr(attn, "q_norm") or (
            attn.q_norm.weight.dtype == KERNEL_DTYPE and attn.k_norm.weight.dtype == KERNEL_DTYPE
            and attn.q_norm.eps == attn.k_norm.eps)
        qkv = linear_site([attn.q_proj, attn.k_proj, attn.v_proj])
        if qkv is not None and qk_ok:
            p.qkv, p.in_quant = qkv, qkv.quant
        if not layer.is_moe and isinstance(mlp, MLP):
            gate_up = linear_site([mlp.gate_proj, mlp.up_proj])
            down = linear_site([mlp.down_proj])
            if gate_up is not None and down is not None:
                p.gate_up, p.down, p.post_quant = gate_up, down, gate_up.quant
        plans.append(p)
    return plans


# ----------------------------------------------------------------------------------------------
# The decode engine


class DecodeEngine:
    """Static KV cache + one decode step per batch bucket, replayed from CUDA graphs (see module doc)."""

    def __init__(self, model: CausalLM, *, graphs: bool = True, fused: bool | None = None):
        dtype = model.model.embed_tokens.weight.dtype
        if dtype != KERNEL_DTYPE:
            raise ValueError(f"Sampler kernels=True needs dtype=torch.bfloat16 (the kernels' activations), "
                             f"got {dtype}; pass dtype=torch.bfloat16 or kernels=False")
        self.model = model
        self.config: ModelConfig = model.config
        self.device = model.model.embed_tokens.weight.device
        self.graphs_enabled = graphs and self.device.type == "cuda"
        self.refreshable = attach_kernels(model)
        self.plans = fused_plans(model)  # None: the fused step does not cover this model
        self.fused = (FUSED if fused is None else fused) and self.plans is not None
        self.static = None  # the SamplerKVCache all generate calls write into
        self.graphs: dict[int, tuple] = {}  # bucket -> (CUDAGraph, outputs, workspaces kept alive)
        self.graph_error: str | None = None
        self.pool = None
        self.counts = {"replays": 0, "eager_steps": 0, "captures": 0}

    # -- cache -----------------------------------------------------------------------------------
    def new_cache(self, kind: str, rows: int, batch: int, total: int):
        """A cache for a prefill of `rows` prompts that becomes `batch` rows of `total` slots: a view
        of the static cache (reallocated, and the graphs dropped, only when it is too small)."""
        need_b = max(rows, batch)
        s = self.static
        if s is None or s.kind != kind or s.batch_size < need_b or s.max_len < total:
            same = s is not None and s.kind == kind  # growing: keep the larger of old and new sizes
            b_cap = max(_pow2(need_b), s.batch_size if same else 1)
            t_cap = max(-(-total // SLOT_ALIGN) * SLOT_ALIGN, s.max_len if same else 0)
            self.graphs.clear()
            self.pool = None  # a private pool whose graphs are all gone must not be captured into again
            self.static = None
            self.static = make_kv_cache(kind, self.config, b_cap, t_cap, dtype=KERNEL_DTYPE,
                                        device=self.device)
            self.static.kind = kind
            dev = self.device
            self.tokens = torch.zeros(b_cap, dtype=torch.long, device=dev)
            self.positions = torch.zeros(b_cap, dtype=torch.long, device=dev)
            self.starts = torch.zeros(b_cap, dtype=torch.int32, device=dev)
            self.lengths = torch.ones(b_cap, dtype=torch.int32, device=dev)
            self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        for r in self.refreshable:  # weight sync may have written new global scales
            r.refresh()
        view = copy.copy(self.static)
        self._narrow(view, rows)
        view.length = 0
        view.select = lambda idx, view=view: self._select(view, idx)
        return view

    def _narrow(self, view, rows: int) -> None:
        for name in self.static.buffer_names:
            setattr(view, name, [b[:rows] for b in getattr(self.static, name)])
        view.batch_size = rows

    def _select(self, view, idx: torch.Tensor) -> None:
        """In place: rows idx of the view become rows 0..len(idx)-1 (the static buffers stay)."""
        end, b = view.length, idx.numel()
        for name in self.static.buffer_names:
            for buf in getattr(self.static, name):
                src = _bytes(buf)[:view.batch_size, :, :end].index_select(0, idx)
                _bytes(buf)[:b, :, :end].copy_(src)
        self._narrow(view, b)

    # -- one decode step ---------------------------------------------------------------------------
    def decode(self, view, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
        """Next-token logits [b, V] and the experts chosen ([b, 1, k] per MoE layer) for one new
        token per row; mask [b, length + 1] is the sampler's (left padding, then real tokens)."""
        b, slots = tokens.numel(), mask.shape[1]
        if slots != view.length + 1 or slots > self.static.max_len or b != view.batch_size:
            raise ValueError(f"decode: mask covers {slots} slots for a cache of {view.length} used, "
                             f"{self.static.max_len} slots, {view.batch_size} rows (got {b} tokens)")
        self.tokens[:b].copy_(tokens.reshape(-1))
        self.positions[:b].copy_(positions.reshape(-1))
        self.starts[:b].copy_(slots - mask.sum(-1))
        self.lengths.fill_(slots)
        self.slot.fill_(slots - 1)
        bucket = min(_pow2(b), self.static.batch_size)
        out = None
        if self.graphs_enabled and self.graph_error is None:
            out = self.graphs[bucket][1] if bucket in self.graphs else self._capture(bucket)
            if out is not None:
                self.graphs[bucket][0].replay()
                self.counts["replays"] += 1
        if out is None:
            out = self._step(bucket)
            self.counts["eager_steps"] += 1
        view.length = slots
        logits, chosen = out
        return logits[:b], [c[:b] for c in chosen]

    def _capture(self, bucket: int):
        """Warm up (compile, tune, allocate) on a side stream, then capture one step; None on failure."""
        from fp4rl.kernels import attention, gemm

        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._step(bucket)  # idempotent: rewrites this step's K/V slot with the same values
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            # the kernels' split-K / attention workspaces: keep the ones this graph uses alive even if
            # a later call grows (replaces) them
            keep = [dict(gemm._WORKSPACE.part), dict(gemm._WORKSPACE.lock), dict(attention._WORKSPACE.bufs)]
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._step(bucket)
        except Exception as exc:  # noqa: BLE001 - any capture failure: decode eagerly, say why
            step = "fused" if self.fused else "module"
            self.graph_error = f"{step} step, batch bucket {bucket}: {type(exc).__name__}: {str(exc)[:300]}"
            warnings.warn(f"CUDA graph capture failed ({self.graph_error}); decoding eagerly", stacklevel=3)
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.device)
            return None
        self.graphs[bucket] = (graph, out, keep)
        self.counts["captures"] += 1
        return out

    def set_fused(self, on: bool) -> bool:
        """Run the fused decode step (where the model allows) or the module-forward one; drops the captured
        graphs and a capture failure (graph_error) when it changes, so that the other step gets its own
        capture (an A/B never compares graphs with eager steps unnoticed: graph_error names the step that
        failed). Returns whether the fused step is on."""
        on = bool(on) and self.plans is not None
        if on != self.fused:
            self.fused = on
            self.graphs.clear()
            self.pool = None
            self.graph_error = None
        return self.fused

    def _step(self, bb: int):
        """The decode step on the static buffers' first bb rows (what a graph captures)."""
        return self._step_fused(bb) if self.fused else self._step_modules(bb)

    def _step_fused(self, bb: int):
        """_step_modules' arithmetic in fused kernels (fp4rl.kernels.fused): per layer one residual-add +
        RMSNorm kernel before attention and one before the MLP, one q/k-norm + RoPE (+ bf16 KV write)
        kernel, one SiLU * up kernel; a W4A4 q/k/v, gate/up or down_proj takes its Q(x) from that kernel.
        Layers (or halves) the plan does not cover run their modules on the norm's bf16 output."""
        from fp4rl.kernels import fused

        m = self.model.model
        x = m.embed_tokens(self.tokens[:bb])  # [bb, H]
        cos, sin = m.rope_tables(self.positions[:bb], x.dtype)  # [bb, D]
        ctx = self._context(bb)
        h, chosen = None, []
        for layer, p in zip(m.layers, self.plans):
            norm = layer.input_layernorm
            x, n, nq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=p.in_quant,
                                         write_y=p.in_quant is None)
            if p.qkv is not None:
                h = self._attention_fused(layer.self_attn, p.qkv.run(n, nq), cos, sin, ctx, bb)
            else:
                h = self._attention(layer.self_attn, n[:, None], cos[:, None, None], sin[:, None, None], ctx,
                                    bb)[:, 0]
            norm = layer.post_attention_layernorm
            x, n, nq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=p.post_quant,
                                         write_y=p.post_quant is None)
            if p.gate_up is not None:
                a, aq = fused.silu_mul(p.gate_up.run(n, nq), quant=p.down.quant, write_y=p.down.quant is None)
                h = p.down.run(a, aq)  # [bb, H]
            elif layer.is_moe:
                h, experts = layer.mlp(n[:, None])  # experts [bb, 1, k]
                chosen.append(experts)
                h = h[:, 0]
            else:
                h = layer.mlp(n[:, None])[:, 0]
        _, n, _ = fused.add_rmsnorm(x, h, m.norm.weight, m.norm.eps)
        return self.model.lm_head(n), chosen  # [bb, V]

    def _attention_fused(self, attn, qkv, cos, sin, ctx, bb: int) -> torch.Tensor:
        """Attention of one token per row from the fused q|k|v projection qkv [bb, (H + 2 H_kv) D]."""
        from fp4rl.kernels import fused

        d, cfg = attn.head_dim, self.config
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        qw = kw = None
        eps = cfg.rms_norm_eps
        if hasattr(attn, "q_norm"):
            qw, kw, eps = attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps
        i, c = attn.layer_idx, self.static
        if c.kind == "bf16":  # k and v go straight to their cache slot
            q, _ = fused.qk_norm_rope(qkv, cos, sin, hq, hkv, d, qw, kw, eps, k_cache=c.k[i], v_cache=c.v[i],
                                      slot=ctx.slot)  # [bb, H, 1, D]
            y = F.scaled_dot_product_attention(q, c.k[i][:bb], c.v[i][:bb], attn_mask=ctx.mask,
                                               enable_gqa=attn.n_rep > 1)[:, :, 0]  # [bb, H, D]
        else:
            q, k = fused.qk_norm_rope(qkv, cos, sin, hq, hkv, d, qw, kw, eps)
            v = qkv[:, (hq + hkv) * d:].view(bb, hkv, 1, d)
            y = self._attend_quantized(c, i, q, k, v, ctx, bb)
        return attn.o_proj(y.reshape(bb, 1, -1))[:, 0]

    def _context(self, bb: int) -> SimpleNamespace:
        ctx = SimpleNamespace(lengths=self.lengths[:bb], starts=self.starts[:bb], slot=self.slot, mask=None)
        if self.static.kind == "bf16":
            key = torch.arange(self.static.max_len, device=self.device)
            visible = (key[None] >= ctx.starts[:, None]) & (key[None] < ctx.lengths[:, None])  # [bb, T_cap]
            ctx.mask = visible[:, None, None]
        return ctx

    def _step_modules(self, bb: int):
        """The decode step through the model's modules (the unfused path)."""
        m = self.model.model
        x = m.embed_tokens(self.tokens[:bb])[:, None]  # [bb, 1, H]
        cos, sin = m.rope_tables(self.positions[:bb, None], x.dtype)  # [bb, 1, D]
        cos, sin = cos[:, None], sin[:, None]  # [bb, 1, 1, D]
        ctx = self._context(bb)
        chosen = []
        for layer in m.layers:
            x = x + self._attention(layer.self_attn, layer.input_layernorm(x), cos, sin, ctx, bb)
            h = layer.post_attention_layernorm(x)
            if layer.is_moe:
                h, experts = layer.mlp(h)  # experts [bb, 1, k]
                chosen.append(experts)
            else:
                h = layer.mlp(h)
            x = x + h
        logits = self.model.lm_head(m.norm(x)[:, 0])  # [bb, V]
        return logits, chosen

    def _attention(self, attn, x, cos, sin, ctx, bb: int) -> torch.Tensor:
        """Attention.forward for one token per row, against the static cache (see module doc)."""
        d = attn.head_dim
        q = attn.q_proj(x).view(bb, 1, -1, d)
        k = attn.k_proj(x).view(bb, 1, -1, d)
        v = attn.v_proj(x).view(bb, 1, -1, d)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [bb, H, 1, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        i, c, kind = attn.layer_idx, self.static, self.static.kind
        if kind == "bf16":
            c.k[i][:bb].index_copy_(2, ctx.slot, k.to(c.k[i].dtype))
            c.v[i][:bb].index_copy_(2, ctx.slot, v.to(c.v[i].dtype))
            y = F.scaled_dot_product_attention(q, c.k[i][:bb], c.v[i][:bb], attn_mask=ctx.mask,
                                               enable_gqa=attn.n_rep > 1)[:, :, 0]  # [bb, H, D]
        else:
            y = self._attend_quantized(c, i, q, k, v, ctx, bb)
        return attn.o_proj(y.reshape(bb, 1, -1))

    @staticmethod
    def _attend_quantized(c, i: int, q, k, v, ctx, bb: int) -> torch.Tensor:
        """Write k/v [bb, H_kv, 1, D] into an FP8 / NVFP4 cache, attend with q [bb, H, 1, D] -> [bb, H, D]."""
        from fp4rl.kernels.attention import decode_attention

        store_kv(c, i, k, v, ctx.slot, bb)
        if c.kind == "nvfp4":
            return decode_attention(q[:, :, 0], ctx.lengths, c.k_data[i][:bb], c.v_data[i][:bb],
                                    c.k_global_scale[i][:bb, :, :, 0], c.v_global_scale[i][:bb, :, :, 0],
                                    k_scale=c.k_block_scale[i][:bb], v_scale=c.v_block_scale[i][:bb],
                                    starts=ctx.starts)
        return decode_attention(q[:, :, 0], ctx.lengths, c.k[i][:bb], c.v[i][:bb],
                                c.k_scale[i][:bb, :, :, 0], c.v_scale[i][:bb, :, :, 0], starts=ctx.starts)


def store_kv(cache, layer: int, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor, bb: int) -> None:
    """Write one token's K/V [bb, H_kv, 1, D] at `slot` ([1] long) of an FP8 or NVFP4 cache's first
    bb rows, quantized as the cache's own `update` quantizes (NVFP4: the Triton quantizer, byte-
    identical to the reference; FP8: the cache's torch quantizer). No host sync."""
    if hasattr(cache, "k_data"):
        from fp4rl.kernels.quantize import quantize_2d

        kw = cache.quantize_kwargs
        for name, t in (("k", k), ("v", v)):
            b, h, _, d = t.shape
            data, scale, g = quantize_2d(t.reshape(-1, d), per_row=True, scale_rule=kw["scale_rule"],
                                         err=kw["err"], check_finite=False)
            _write(getattr(cache, f"{name}_data")[layer][:bb], slot, data.view(b, h, 1, d // 2))
            _write(getattr(cache, f"{name}_block_scale")[layer][:bb], slot, scale.view(b, h, 1, d // 16))
            _write(getattr(cache, f"{name}_global_scale")[layer][:bb], slot, g.view(b, h, 1, 1))
    else:
        for codes, scales, t in ((cache.k, cache.k_scale, k), (cache.v, cache.v_scale, v)):
            q, s = cache.quantize(t)
            _write(codes[layer][:bb], slot, q)
            _write(scales[layer][:bb], slot, s)

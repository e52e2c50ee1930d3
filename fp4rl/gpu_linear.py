"""The sampler's linears on the GPU kernels (swapped in by `attach_kernels`, with the routed experts of
`fp4rl.gpu_experts`), and the decode copies of their weights. `fp4rl.gpu_decode.DecodeEngine` runs them
inside its CUDA-graph decode step.

- Packed NVFP4 linears (`KernelPackedLinear`): W4A16 runs `fp4rl.kernels.gemm`, y = (sum_k x_k *
  (e2m1 * s)_k) * g_w with an FP32 accumulator, the weight dequantized in registers. W4A4 first
  quantizes x per token with `fp4rl.kernels.quantize` (byte-identical to the trainer's
  `fp4rl.nvfp4.quantize` with the contract's activation settings, so Q(x) is the trainer's), or takes
  that Q(x) from the fused step's producer kernel, then runs the exact-operand block-scaled product
  (e2m1 s)_x (e2m1 s)_w * g_x * g_w that an FP4 MMA computes. Against the CPU path (DQ(Q(x)) @ DQ(W).T on
  operands rounded to bfloat16) both differ by bfloat16 rounding only; rows of x never interact, so the
  result does not depend on the batch. Above `gemm_tune.DECODE_MAX_ROWS` rows (prefill) an untuned engine uses
  the kernels' dequantize-then-cuBLAS path (measured best at 512 rows, bench/RESULTS.md).
- Decode copies (`_DecodeCopy`): at 1-16 rows the dense linears run the CUDA mma16 kernel
  (`fp4rl.kernels.gemv_cuda`, W4A16 and W4A4) on a re-laid-out copy of each weight, where it runs (Hopper,
  NVRTC; `MMA16`, env FP4RL_MMA16=0 to turn it off), else the Gluon GEMV on a gemv32 copy at 1-4 rows
  (W4A16). The copies follow in-place weight writes (rebuilt in the same storage when the bytes' version
  changes; `refresh()` before every graph capture and `generate`).
- Fused q/k/v and gate/up (`KernelFusedGroup`): the members' packed bytes become views of one
  [sum N, K/2] buffer (weight sync writes through them), one kernel call per group, one Q(x) in
  W4A4; the members' global scales are copied into a per-row vector at every `generate`.
- Routed experts: `fp4rl.gpu_experts` (`KernelMoeBlock`, swapped in by `attach_kernels` too).
- Dense copies (`_DenseCopy`, `Sampler(dense_rows=R)`, off by default): each packed dense linear and fused
  group also keeps DQ(W) in bfloat16 (the reference dequantize, +2 B per weight), and calls of at least R rows
  (large decode batches, prefill) may run cuBLAS on it (`gemm_tune.DENSE`): the BF16 engine's speed and the
  reference's arithmetic (DQ(Q(x)) @ DQ(W).T with bfloat16 operands) on the quantized policy. The GEMM tuner
  (TUNE) times it against the 4-bit kernels per shape and row bucket and keeps the faster; untuned it is
  taken. Rebuilt in place like the decode copies. Routed experts keep the grouped kernels: on an H200 their
  4-bit grouped GEMM ran 1.54-1.92x `torch._grouped_mm` at 16-512 rows over 8 experts and the tuner kept it
  over a dense copy at every row count (bench/RESULTS.md, twenty-second session).
- The residual add + RMSNorm before a dense W4A16 linear or group inside its mma16 launch (`norm_run`,
  `prenorm_gemm`: gemv_cuda_prenorm.launch_prenorm, where the kernel stages x whole; the fused step's
  `gpu_decode.DENSE_NORM`).
- BF16 weights (lm_head, embeddings, BF16 layers) stay on cuBLAS.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from torch import nn

from fp4rl.kernels import pdl
from fp4rl.model import CausalLM
from fp4rl.moe import SparseMoeBlock
from fp4rl.packed import FusedGroup, PackedNVFP4Linear, _version

KERNEL_DTYPE = torch.bfloat16
TUNE = True  # time the GEMM candidates per shape on first use (gemm.tune); False: first candidate, no timing
GEMV32 = True  # keep decode copies at all (see _DecodeCopy)
MMA16 = os.environ.get("FP4RL_MMA16", "1") != "0"  # the CUDA mma16 copy where it runs (else gemv32)


# ----------------------------------------------------------------------------------------------
# GEMMs


def packed_gemm(x2: torch.Tensor | None, weight, mode: str, input_kwargs: dict, offsets=None,
                xq=None, tokens: int | None = None, rows: torch.Tensor | None = None,
                silu: bool = False, silu_out: bool = False) -> torch.Tensor:
    """x2 [M, K] bfloat16 @ DQ(weight).T (weight: .data/.block_scale/.global_scale), W4A16 or W4A4
    (x quantized per token with the contract's settings first, or xq: that Q(x) already made by a fused
    producer, (data, block_scale, global_scale [M])); offsets: grouped experts, tokens: the batch's tokens
    (gemm.gemm); rows (grouped): int32 [M], x2 holds the tokens and sorted row r is x2[rows[r]]; silu: x2 is
    [M, 2K] gate | up and the GEMM's input is fused.silu_mul(x2) (W4A16: gemm.gemm(silu=); W4A4: silu_mul
    quantizes its output in the same launch); silu_out (W4A16, a fused gate | up weight): returns
    fused.silu_mul(y)[0] [M, N/2] (gemm.gemm(silu_out=): in the GEMM's epilogue where its launch takes it)."""
    from fp4rl.kernels import fused, gemm, gemm_tune

    if silu_out and (mode != "w4a16" or silu or rows is not None or xq is not None or offsets is not None):
        raise ValueError("packed_gemm: silu_out is for a dense W4A16 gate | up weight with x2 only")

    if silu and (rows is not None or xq is not None or x2 is None):
        raise ValueError("packed_gemm: silu takes x2 = gate | up [M, 2K] only (no rows, no xq)")
    if silu and mode != "w4a16":  # W4A4: SiLU * up and the per-token quantizer in one launch
        _, xq = fused.silu_mul(x2, quant=dict(scale_rule=input_kwargs["scale_rule"], err=input_kwargs["err"]),
                               write_y=False)
        x2, silu = None, False

    if rows is not None and mode != "w4a16":  # W4A4: quantize the sorted rows, as without rows
        if xq is not None:
            raise ValueError("packed_gemm: rows and xq together: pass the sorted rows' Q(x) without rows")
        x2, rows = x2.index_select(0, rows), None

    if xq is not None and mode != "w4a4":
        raise ValueError(f"packed_gemm: xq (a pre-quantized activation) is for W4A4 only, got mode {mode!r}; "
                         "pass x2 (the fused step's plan gives W4A16 sites no quantizer)")
    if x2 is None and xq is None:
        raise ValueError("packed_gemm: pass x2 [M, K] (or, W4A4, its Q(x) as xq)")
    config = None
    m = x2.shape[0] if xq is None else xq[0].shape[0]
    wide = getattr(weight, "mma16", None) is not None and gemm.wide_candidate(m, weight.data.shape[-2])
    if not TUNE and offsets is None and m > gemm_tune.DECODE_MAX_ROWS and not wide:
        config = gemm_tune.FALLBACK  # (a weight with its mma16 copy: the wgmma build, WIDE, up to 512 rows)
    if mode == "w4a16":
        return gemm.gemm(x2, weight, offsets=offsets, tune=TUNE, config=config, tokens=tokens, rows=rows,
                         silu=silu, silu_out=silu_out)
    if xq is None:
        xq = gemm.quantize_activations(x2, scale_rule=input_kwargs["scale_rule"], err=input_kwargs["err"])
    return gemm.gemm(None, weight, xq=xq, offsets=offsets, tune=TUNE, config=config, tokens=tokens)


def prenorm_gemm(owner, data, scale, g, mode: str, x2: torch.Tensor, h: torch.Tensor | None, norm: nn.Module,
                 moe: tuple | None = None):
    """(x', y) = the decode step's residual add + RMSNorm (x' = x2 + h, or x2 + moe_route.combine(*moe) with h
    None; then `norm`) and the owner's GEMM of its output in one launch (gemv_cuda_prenorm.launch_prenorm on
    the owner's mma16 decode copy; the norm's arithmetic is fp4rl.kernels.prenorm's), or None where that
    launch does not take the call: W4A4 (its Q(x) comes from the norm kernel), TRACE recording, no mma16 copy
    (no Hopper / NVRTC, a shape it does not take, a stale copy inside a capture), rows or shared memory past
    gemv_cuda_prenorm.prenorm_plan. A kernel failure turns it off for the process with a warning
    (gemv_cuda_prenorm.disable_prenorm) and returns None: the caller runs add_rmsnorm and the GEMM."""
    from fp4rl.kernels import gemv_cuda_prenorm

    if (mode != "w4a16" or owner.trace_guide is not None or x2.dtype != KERNEL_DTYPE
            or not MMA16 or not gemv_cuda_prenorm.prenorm_available(x2.device, moe is not None)):
        return None
    copy = mma16_copy(owner._swz(), data, scale)
    if copy is None:
        return None
    y = torch.empty(x2.shape[0], copy.n, dtype=KERNEL_DTYPE, device=x2.device)
    try:
        return gemv_cuda_prenorm.launch_prenorm(x2, h, norm.weight, norm.eps, copy, g, y, moe=moe)
    except ValueError:  # operands it does not take (e.g. a norm weight not 16-byte aligned): this call only
        return None
    except RuntimeError as exc:  # NVRTC or the driver refused it
        gemv_cuda_prenorm.disable_prenorm(exc, moe is not None)
        return None


# The residual add + RMSNorm split over the GEMMs around it (gpu_decode.RESNORM; fp4rl.kernels.resnorm): "ok"
# False once a kernel failed (a warning; the step runs add_rmsnorm again); EMULATE: without the kernels (CPU
# tests of the step's plumbing) the sites compute resnorm.produce / consume on their plain output instead
RN_STATE = {"ok": True}
RN_EMULATE = False


def _rn_plan(owner, data, scale, rows: int, device, out: bool):
    """(mma16 copy, configuration) of an RN_OUT (out) / RN_IN launch of the owner's W4A16 weight on `rows`
    rows, or None where the kernel does not take it (W4A4, TRACE recording, no mma16 copy or Hopper NVRTC, a
    dense copy at these rows, a configuration without the build: gemv_cuda.rn_ok)."""
    from fp4rl.kernels import gemm, gemv_cuda

    if (not RN_STATE["ok"] or not MMA16 or getattr(owner, "mode", None) == "w4a4" or device.type != "cuda"
            or owner.trace_guide is not None or not gemv_cuda.available(device)):
        return None
    if owner.dense_rows and rows >= owner.dense_rows:
        return None
    copy = mma16_copy(owner._swz(), data, scale)
    if copy is None:
        return None
    cfg = gemm._mma16_config(rows, copy.n, copy.k, None, device)
    return (copy, cfg) if cfg is not None and gemv_cuda.rn_ok(cfg, copy.n, out) else None


def _rn_failed(exc: Exception) -> None:
    import warnings

    RN_STATE["ok"] = False
    warnings.warn(f"the mma16 RN_OUT / RN_IN build failed ({type(exc).__name__}: {str(exc)[:300]}); the "
                  "decode step runs fused.add_rmsnorm between its GEMMs from now on", stacklevel=3)


def rn_out_run(owner, data, scale, g, x2: torch.Tensor, res: torch.Tensor, norm: nn.Module):
    """The producer's half of the split norm (resnorm.produce): (x', xt, ss) from the owner's GEMM of x2, the
    residual res and the next norm; None where neither the kernel (_rn_plan) nor RN_EMULATE takes it (the
    caller runs its plain path)."""
    from fp4rl.kernels import gemv_cuda, resnorm

    m = x2.shape[0]
    plan = _rn_plan(owner, data, scale, m, x2.device, True)
    if plan is not None:
        copy, cfg = plan
        n = copy.n
        xo = torch.empty(m, n, dtype=KERNEL_DTYPE, device=x2.device)
        xt = torch.empty(m, n, dtype=KERNEL_DTYPE, device=x2.device)
        ss = torch.empty(m, n // 16, dtype=torch.float32, device=x2.device)
        try:
            gemv_cuda.launch(x2, copy, g, xt, cfg=cfg, rn_out=(res, xo, norm.weight, ss))
            return xo, xt, ss
        except (ValueError, TypeError):  # operands it does not take: this call runs unsplit
            return None
        except RuntimeError as exc:  # NVRTC or the driver refused it: unsplit from now on
            _rn_failed(exc)
            return None
    if RN_EMULATE:
        return resnorm.produce(res, owner.run(x2), norm.weight)
    return None


def rn_in_run(owner, data, scale, g, xt: torch.Tensor, ss: torch.Tensor, eps: float, silu_out: bool = False):
    """The consumer's half (resnorm.rstd, then y = bf16((acc g) rstd)) on the producer's xt and ss; silu_out:
    fused.silu_mul of it (a gate | up group: in the same launch where GU_SILU takes the configuration).
    Always returns y: where the kernel does not run (it failed here, or RN_EMULATE) resnorm.consume on the
    plain GEMM of xt."""
    from fp4rl.kernels import fused, gemv_cuda, resnorm

    m = xt.shape[0]
    plan = _rn_plan(owner, data, scale, m, xt.device, False)
    if plan is not None:
        copy, cfg = plan
        both = silu_out and gemv_cuda.gu_silu_ok(cfg, copy.n)
        y = torch.empty(m, copy.n // 2 if both else copy.n, dtype=KERNEL_DTYPE, device=xt.device)
        try:
            gemv_cuda.launch(xt, copy, g, y, cfg=cfg, silu_out=both, rn_in=(ss, eps))
            return y if both or not silu_out else fused.silu_mul(y)[0]
        except (ValueError, TypeError):  # operands it does not take: this call on the plain GEMM below
            pass
        except RuntimeError as exc:
            _rn_failed(exc)
    y = resnorm.consume(owner.run(xt), ss, eps)
    return fused.silu_mul(y)[0] if silu_out else y


def rn_takes(owner, data, scale, rows: int, device, out: bool) -> bool:
    """Whether the owner's rn_out_run (out) / rn_in_run run the split at `rows` rows (the kernel, or
    RN_EMULATE)."""
    if getattr(owner, "mode", "w4a16") != "w4a16" or owner.trace_guide is not None:
        return False
    return RN_EMULATE or _rn_plan(owner, data, scale, rows, device, out) is not None


def mma16_copy(cache: _DecodeCopy, data: torch.Tensor, scale: torch.Tensor):
    """The cache's mma16 copy (gemv_cuda.Mma16Weight) of the weight, up to date, or None (a gemv32 copy or
    none)."""
    copy = cache.get(data, scale)
    return None if copy is None or isinstance(copy, torch.Tensor) else copy


class _DecodeCopy:
    """The decode copy of one packed weight for the 1-16 row kernels: the CUDA mma16 kernel's copy
    (fp4rl.kernels.gemv_cuda.relayout: codes and block scales re-laid out, +0.625 B per weight) where that
    kernel runs and the shape fits, else the Gluon GEMV's gemv32 copy of the codes (+0.5 B per weight). The
    kind is chosen at the first build and kept, so a copy that a captured CUDA graph reads keeps following
    the weights even if its kernel is disabled later. Rebuilt in place (same storage: captured graphs stay
    valid) when the bytes' or scales' version or storage changes, or after invalidate(); never inside a
    graph capture (the engine refreshes before capturing)."""

    def __init__(self):
        self.copy = None  # gemv_cuda.Mma16Weight or the gemv32 uint8 tensor
        self.key = None

    def get(self, data: torch.Tensor, scale: torch.Tensor, mma16_only: bool = False):
        """The copy, up to date (None where no decode kernel serves these bytes; mma16_only: W4A4, which only
        the mma16 kernel serves)."""
        if not GEMV32 or data.device.type != "cuda" or data.ndim != 2:
            return None
        from fp4rl.kernels import gemv, gemv_cuda

        if self.copy is None:
            sms = torch.cuda.get_device_properties(data.device).multi_processor_count
            mma = MMA16 and gemv_cuda.available(data.device) and gemv_cuda.fits(
                data.shape[0], 2 * data.shape[1], 1, sms)
            if not mma and (mma16_only or not gemv.available() or data.shape[-1] % 4):
                return None
        else:
            mma = not isinstance(self.copy, torch.Tensor)
            if mma16_only and not mma:
                return None
        key = (_version(data), data.data_ptr(), _version(scale), scale.data_ptr(), tuple(data.shape))
        if key != self.key:
            if torch.cuda.is_current_stream_capturing():
                return None
            with torch.inference_mode(False):  # normal tensors: rebuilt in place in or out of inference mode
                self.copy = _rebuild(self.copy, data, scale, mma)
            self.key = key
            pdl.hazard()  # the next GEMM must not prefetch these bytes before the rebuild has finished
        return self.copy

    def invalidate(self) -> None:
        self.key = None  # the copy's storage is reused by the next get()

    @property
    def nbytes(self) -> int:
        if self.copy is None:
            return 0
        if isinstance(self.copy, torch.Tensor):
            return self.copy.nbytes
        return self.copy.wt.nbytes + self.copy.st.nbytes


def _rebuild(old, data: torch.Tensor, scale: torch.Tensor, mma: bool):
    """A decode copy of (data, scale), written into `old`'s storage when the shapes allow."""
    from fp4rl.kernels import gemv, gemv_cuda

    if not mma:
        return gemv.swizzle(data, out=old if old is not None and old.shape == data.shape else None)
    fresh = gemv_cuda.relayout(data, scale)
    if old is None or old.wt.shape != fresh.wt.shape:
        return fresh
    old.wt.copy_(fresh.wt)
    old.st.copy_(fresh.st)
    return old


DENSE_CHUNK = 1 << 24  # elements per float32 chunk of a dense copy's rebuild (64 MB)


def _dense_oom(rows: int, n: int, k: int, device, exc: Exception) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(
        f"Sampler(dense_rows={rows}) (config sampler.dense_rows): the bfloat16 copy of a {n}x{k} NVFP4 "
        f"weight ({n * k * 2 / 2**20:.0f} MiB; the copies take 2 B per weight of every packed dense linear) "
        f"does not fit in {device}'s free memory. Set sampler.dense_rows = 0 (the 4-bit kernels at every "
        f"batch), or free memory (e.g. offload the trainer). {exc}")


class _DenseCopy:
    """DQ(W) of one packed dense weight (or fused group) in bfloat16, for the calls of at least `rows` rows
    (`Sampler(dense_rows=...)`): `fp4rl.kernels.dequantize`, bit-identical to the reference's. Rebuilt in
    place (same storage: captured graphs stay valid) when the bytes', block scales' or global scales' version
    or storage changes, or after invalidate(); never inside a graph capture (the engine refreshes first)."""

    def __init__(self, rows: int):
        self.rows = rows
        self.copy: torch.Tensor | None = None
        self.key = None

    def get(self, data: torch.Tensor, scale: torch.Tensor, g: torch.Tensor,
            g_key=None) -> torch.Tensor | None:
        """The copy, up to date (None inside a capture while it is stale). g_key: what identifies g's values
        (default: g's version and storage; a fused group passes its members' global scales', since its
        per-row vector is rewritten at every refresh)."""
        from fp4rl.kernels.dequantize import dequantize

        if g_key is None:
            g_key = (_version(g), g.data_ptr())
        key = (_version(data), data.data_ptr(), _version(scale), scale.data_ptr(), g_key, tuple(data.shape))
        if key != self.key:
            if data.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            n, k = data.shape[0], 2 * data.shape[1]
            if self.copy is None or tuple(self.copy.shape) != (n, k):
                with torch.inference_mode(False):  # a normal tensor: rebuilt in place in or out of inference
                    try:
                        self.copy = torch.empty(n, k, dtype=torch.bfloat16, device=data.device)
                    except torch.OutOfMemoryError as exc:
                        raise _dense_oom(self.rows, n, k, data.device, exc) from exc
            # float32 in chunks of <= DENSE_CHUNK elements, rounded by torch (Triton's interpreter truncates
            # float32 -> bfloat16 casts; the GPU kernel rounds to nearest even, as torch)
            g = g.float().reshape(-1)
            step = max(1, DENSE_CHUNK // k)
            for r in range(0, n, step):
                gr = g if g.numel() == 1 else g[r:r + step]
                rows = slice(r, r + step)
                self.copy[rows].copy_(dequantize(data[rows], scale[rows], gr, torch.float32))
            self.key = key
            pdl.hazard()  # the next GEMM must not prefetch weights before the rebuild has finished
        return self.copy

    def invalidate(self) -> None:
        self.key = None  # the copy's storage is reused by the next get()

    @property
    def nbytes(self) -> int:
        return 0 if self.copy is None else self.copy.nbytes


def _dense_for(owner, data, scale, g, rows: int, g_key=None):
    """The owner's dense copy when this call has enough rows for it (`dense_rows`), else None."""
    if not owner.dense_rows or rows < owner.dense_rows:
        return None
    if owner._dense is None:
        owner._dense = _DenseCopy(owner.dense_rows)
    return owner._dense.get(data, scale, g, g_key)


def _with_dense(weight, dense):
    """The weight (with its decode copy, if _with_copy gave it one) carrying the dense copy too: gemm weighs
    the decode kernels against cuBLAS on it."""
    if dense is None:
        return weight
    return SimpleNamespace(data=weight.data, block_scale=weight.block_scale, global_scale=weight.global_scale,
                           dense=dense, mma16=getattr(weight, "mma16", None),
                           gemv32=getattr(weight, "gemv32", None))


def dense_copy_bytes(model: nn.Module) -> int:
    """Device bytes of the dense bfloat16 copies (`Sampler(dense_rows=...)`) that the kernel linears and
    groups hold."""
    owners = list(model.modules()) + list(getattr(model, "fused_groups", []))
    return sum(o._dense.nbytes for o in owners if getattr(o, "_dense", None) is not None)


def decode_copy_bytes(model: nn.Module) -> int:
    """Device bytes of every decode copy (mma16 or gemv32) that the kernel linears and groups hold."""
    from fp4rl.gpu_experts import KernelMoeBlock, _PackedExperts

    owners = list(model.modules()) + list(getattr(model, "fused_groups", []))
    dense = sum(o._gemv32.nbytes for o in owners if getattr(o, "_gemv32", None) is not None)
    return dense + sum(m.plan.copy_bytes for m in model.modules()
                       if isinstance(m, KernelMoeBlock) and isinstance(m.plan, _PackedExperts))


def _with_copy(weight, copy):
    if copy is None:
        return weight
    kind = "gemv32" if isinstance(copy, torch.Tensor) else "mma16"
    return SimpleNamespace(data=weight.data, block_scale=weight.block_scale, global_scale=weight.global_scale,
                           **{kind: copy})


def _decode_copy(cache: _DecodeCopy, data, scale, mode: str, x2, xq=None):
    """The decode copy for this call, or None: the mma16 copy serves W4A16 and W4A4 at 1-16 rows
    (gemm.MMA16_MAX_ROWS) and, with its wgmma configuration on sm_90, the rows of gemm.wide_rows (and those
    of gemm.wide_candidate, where the tuner weighs it against the Triton kernels); the gemv32 copy W4A16 at
    1-4 rows."""
    from fp4rl.kernels import gemm, gemv_cuda

    rows = x2.numel() // x2.shape[-1] if x2 is not None else xq[0].shape[0]
    n = data.shape[-2]
    if rows > gemm.MMA16_MAX_ROWS and not (MMA16 and (gemm.wide_rows(rows, n) or gemm.wide_candidate(rows, n))
                                           and gemv_cuda.wide_available(data.device)):
        return None
    copy = cache.get(data, scale, mma16_only=mode != "w4a16")
    return None if isinstance(copy, torch.Tensor) and rows > 4 else copy


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
    _dense = None
    dense_rows = 0  # calls of at least this many rows run cuBLAS on a DQ(W) copy (0: never; attach_kernels)
    trace_guide = None  # W4A4: a gpu_trace.Guide while the engine records TRACE guidance

    def refresh(self) -> None:
        """Rebuild the decode (and dense) copy if the packed bytes changed (called before graph capture and
        replay)."""
        self._swz().get(self.weight_data, self.weight_block_scale, mma16_only=self.mode != "w4a16")
        _dense_for(self, self.weight_data, self.weight_block_scale, self.weight_global_scale, self.dense_rows)

    def invalidate(self) -> None:
        super().invalidate()
        if self._gemv32 is not None:
            self._gemv32.invalidate()
        if self._dense is not None:
            self._dense.invalidate()

    def _swz(self) -> _DecodeCopy:
        if self._gemv32 is None:
            self._gemv32 = _DecodeCopy()
        return self._gemv32

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ DQ(W).T + b with the W4A16 kernel (x as given)."""
        if x.dtype != KERNEL_DTYPE:
            return super().linear(x)
        x2 = x.reshape(-1, x.shape[-1])
        w = self._weight_for(x2, None, "w4a16")
        y = packed_gemm(x2, w, "w4a16", self.input_kwargs)
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
        if self.trace_guide is not None:  # TRACE on the engine: Q(x) made here and its guidance written
            xq = self.trace_guide.quantized(x2, xq, self.input_kwargs)
        w = self._weight_for(x2, xq, "w4a4")
        y = packed_gemm(x2, w, "w4a4", self.input_kwargs, xq=xq)
        return y if self.bias is None else y + self.bias

    def norm_run(self, x2: torch.Tensor, h: torch.Tensor | None, norm: nn.Module, moe: tuple | None = None):
        """(x', run(norm(x'))), x' = x2 + h (or + the MoE combine), in one launch where `prenorm_gemm` takes
        it, else None."""
        out = prenorm_gemm(self, self.weight_data, self.weight_block_scale, self.weight_global_scale,
                           self.mode, x2, h, norm, moe)
        if out is None or self.bias is None:
            return out
        return out[0], out[1] + self.bias

    def rn_takes(self, rows: int, device, out: bool) -> bool:
        """Whether rn_out (out) / rn_in run the split residual add + RMSNorm here (no bias;
        gpu_linear.rn_takes)."""
        return self.bias is None and rn_takes(self, self.weight_data, self.weight_block_scale, rows, device,
                                              out)

    def rn_out(self, x2: torch.Tensor, res: torch.Tensor, norm: nn.Module):
        """(x', xt, ss): this GEMM of x2 as the producer of the split norm (gpu_linear.rn_out_run)."""
        return rn_out_run(self, self.weight_data, self.weight_block_scale, self.weight_global_scale, x2, res,
                          norm)

    def rn_in(self, xt: torch.Tensor, ss: torch.Tensor, eps: float):
        """This GEMM as the consumer of the split norm (gpu_linear.rn_in_run)."""
        return rn_in_run(self, self.weight_data, self.weight_block_scale, self.weight_global_scale, xt, ss,
                         eps)

    def _weight_for(self, x2, xq, mode: str):
        """The weight with the copies this call may run on: the decode copy where one serves these rows, and
        the dense copy at dense_rows rows and more."""
        rows = x2.shape[0] if x2 is not None else xq[0].shape[0]
        dense = _dense_for(self, self.weight_data, self.weight_block_scale, self.weight_global_scale, rows)
        copy = _decode_copy(self._swz(), self.weight_data, self.weight_block_scale, mode, x2, xq)
        return _with_dense(_with_copy(self.quantized_weight(), copy), dense)


class KernelFusedGroup(FusedGroup):
    """A FusedGroup of packed linears computed as one kernel call on a stacked weight."""

    _dense = None
    dense_rows = 0  # as KernelPackedLinear's
    trace_guide = None  # as KernelPackedLinear's

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
        _dense_for(self, self.data, self.scale, self.g_rows, self.dense_rows, self._g_key())

    def _g_key(self) -> tuple:
        """The members' global scales' versions and storage: g_rows is rewritten at every refresh."""
        return tuple((_version(g), g.data_ptr()) for g in (m.weight_global_scale for m in self.members))

    def invalidate(self) -> None:
        super().invalidate()
        if getattr(self, "_gemv32", None) is not None:
            self._gemv32.invalidate()
        if self._dense is not None:
            self._dense.invalidate()

    def _swz(self) -> _DecodeCopy:
        if getattr(self, "_gemv32", None) is None:
            self._gemv32 = _DecodeCopy()
        return self._gemv32

    def run(self, x2: torch.Tensor | None, xq=None) -> torch.Tensor:
        """The whole group's y [M, sum N] for x2 [M, K] bfloat16, or (W4A4) for its Q(x) made by a fused
        producer (then x2 may be None)."""
        m0 = self.members[0]
        if self.trace_guide is not None and m0.mode == "w4a4":
            xq = self.trace_guide.quantized(x2, xq, m0.input_kwargs)
        y = packed_gemm(x2, self._stacked(x2, xq), m0.mode, m0.input_kwargs, xq=xq)
        return y if self.bias_cat is None else y + self.bias_cat

    def _stacked(self, x2, xq):
        """The stacked weight with the copies this call may run on (as KernelPackedLinear._weight_for)."""
        w = SimpleNamespace(data=self.data, block_scale=self.scale, global_scale=self.g_rows)
        dense = _dense_for(self, self.data, self.scale, self.g_rows,
                           x2.shape[0] if x2 is not None else xq[0].shape[0], self._g_key())
        copy = _decode_copy(self._swz(), self.data, self.scale, self.members[0].mode, x2, xq)
        return _with_dense(_with_copy(w, copy), dense)

    @property
    def takes_silu_out(self) -> bool:
        """Whether `silu_run` serves this group: a W4A16 gate | up pair (two members of equal width, no
        bias)."""
        return (len(self.members) == 2 and self.splits[0] == self.splits[1] and self.bias_cat is None
                and self.members[0].mode == "w4a16")

    def silu_run(self, x2: torch.Tensor) -> torch.Tensor:
        """fused.silu_mul(run(x2))[0] [M, I] for a gate | up pair (`takes_silu_out`): in the GEMM's launch
        where it takes it (gemm.gemm(silu_out=True)), the same bits."""
        if not self.takes_silu_out:
            raise ValueError("silu_run is for a W4A16 gate | up group (two members of equal width, no bias)")
        return packed_gemm(x2, self._stacked(x2, None), "w4a16", self.members[0].input_kwargs, silu_out=True)

    @property
    def mode(self) -> str:
        return self.members[0].mode

    def rn_takes(self, rows: int, device, out: bool = False) -> bool:
        """Whether rn_in runs the consumer's half of the split norm here (no bias; gpu_linear.rn_takes; a
        group is never a producer: out False)."""
        return (not out and self.bias_cat is None
                and rn_takes(self, self.data, self.scale, rows, device, False))

    def rn_in(self, xt: torch.Tensor, ss: torch.Tensor, eps: float, silu_out: bool = False):
        """The group as the consumer of the split norm (gpu_linear.rn_in_run); silu_out: a gate | up group's
        fused.silu_mul of it (`takes_silu_out`)."""
        if silu_out and not self.takes_silu_out:
            raise ValueError("rn_in(silu_out=True) is for a W4A16 gate | up group (two members, equal width)")
        return rn_in_run(self, self.data, self.scale, self.g_rows, xt, ss, eps, silu_out)

    def norm_run(self, x2: torch.Tensor, h: torch.Tensor | None, norm: nn.Module, moe: tuple | None = None):
        """(x', run(norm(x'))), x' = x2 + h (or + the MoE combine), in one launch where `prenorm_gemm` takes
        it, else None."""
        out = prenorm_gemm(self, self.data, self.scale, self.g_rows, self.members[0].mode, x2, h, norm, moe)
        if out is None or self.bias_cat is None:
            return out
        return out[0], out[1] + self.bias_cat

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


def attach_kernels(model: CausalLM, dense_rows: int = 0) -> list:
    """Swap the sampler model's packed linears, fused packed groups and MoE blocks to the kernel
    versions (in place). dense_rows > 0: the dense linears and groups (not the routed experts) keep a DQ(W)
    copy for calls of at least that many rows (_DenseCopy). Returns the objects whose derived global scales
    and copies `refresh()` renews."""
    from fp4rl.gpu_experts import KernelMoeBlock, expert_plan

    if not isinstance(dense_rows, int) or isinstance(dense_rows, bool) or dense_rows < 0:
        raise ValueError(f"dense_rows={dense_rows!r}: an integer >= 0 (0: no dense copies)")
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
            group.dense_rows = dense_rows
            group.attach()
            refresh.append(group)
    for module in model.modules():
        if kernel_ready(module):
            module.__class__ = KernelPackedLinear
            if module.group is None and id(module) not in expert_linears:
                module.dense_rows = dense_rows  # (a group's members run through the group's copy)
                refresh.append(module)
    return refresh

"""The sampler's routed experts on the GPU kernels (`KernelMoeBlock`, swapped in by
`fp4rl.gpu_linear.attach_kernels`; `fp4rl.gpu_decode.DecodeEngine` runs them inside its CUDA-graph step).

The (token, expert) pairs are sorted by expert on the device (no host sync), gate/up and down of all experts
run as two grouped GEMMs over [E, N, K/2] stacks (`gemm.grouped_linear`, or W4A4 on one Q(x) per row; the
grouped CUDA mma16 kernel on a stacked decode copy while the rows per expert are few); BF16 experts use
`torch._grouped_mm` on [E, N, K] stacks. The k expert outputs of a token are weighted and summed in FP32 (the
CPU loop adds them in bfloat16, expert by expert). At decode sizes the route and the combine are two kernels
(`fp4rl.kernels.moe_route`).
"""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from fp4rl import gpu_linear
from fp4rl.gpu_linear import KERNEL_DTYPE, _DecodeCopy, kernel_ready
from fp4rl.moe import SparseMoeBlock
from fp4rl.packed import PrepackedLinear


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
        self.copies = (_DecodeCopy(), _DecodeCopy())  # the mma16 copies of the gate/up and down stacks
        self.trace_guide = None  # a gpu_trace.ExpertGuide while the engine records TRACE guidance
        self.refresh()

    def _copy(self, which: int):
        """The stacked mma16 copy (gemv_cuda_grouped.relayout_stack's layout) of gate/up (0) or down (1), or
        None."""
        from fp4rl.kernels import gemv_cuda

        data, scale = (self.gu_data, self.gu_scale) if which == 0 else (self.d_data, self.d_scale)
        c = self.copies[which].get(data.reshape(-1, data.shape[-1]), scale.reshape(-1, scale.shape[-1]),
                                   mma16_only=True)
        return None if c is None else gemv_cuda.Mma16Weight(wt=c.wt, st=c.st, n=data.shape[1], k=c.k)

    @property
    def copy_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies)

    def invalidate(self) -> None:
        for c in self.copies:
            c.invalidate()

    def refresh(self) -> None:
        for which in (0, 1):  # rebuild the decode copies if the bytes moved (never inside a capture)
            self._copy(which)
        e, i = self.gu_g.shape[0], self.gu_g.shape[1] // 2
        g = torch.stack([m.weight_global_scale.float().reshape(()) for m in self.gates])
        u = torch.stack([m.weight_global_scale.float().reshape(()) for m in self.ups])
        self.gu_g.copy_(torch.cat([g[:, None].expand(e, i), u[:, None].expand(e, i)], 1))
        self.d_g.copy_(torch.stack([m.weight_global_scale.float().reshape(()) for m in self.downs]))

    def _run(self, which: int, x, offsets, tokens, rows=None, silu=False, pairs=None):
        data, scale, g = ((self.gu_data, self.gu_scale, self.gu_g) if which == 0
                          else (self.d_data, self.d_scale, self.d_g))
        w = SimpleNamespace(data=data, block_scale=scale, global_scale=g)
        if tokens is not None:  # (gemm takes the grouped mma16 kernel while the rows per expert are few)
            c = self._copy(which)
            if c is not None:
                w.mma16 = c
        xq = None
        key = None if self.trace_guide is None else (self.trace_guide.gate_up, self.trace_guide.down)[which]
        if key is not None and self.mode == "w4a4":  # TRACE on the engine: Q(x) made here, its guidance kept
            x, xq = self._guided(which, key, x, rows, silu, pairs)
            rows, silu = None, False
        # (through the module: the linears and the experts share one packed_gemm, one point to wrap)
        return gpu_linear.packed_gemm(None if xq is not None else x, w, self.mode, self.input_kwargs, offsets,
                                      xq=xq, tokens=tokens, rows=rows, silu=silu)

    def _guided(self, which: int, key: str, x, rows, silu, pairs):
        """(x, Q(x)) of the sorted rows after writing the guidance of key (gpu_trace module doc)."""
        from fp4rl.kernels import fused, gemm

        if pairs is None:
            raise RuntimeError(f"TRACE on the kernel engine: {key} needs the sorted row of each (token, "
                               "slot) pair (pairs=) to record its guidance by token")
        kw = dict(scale_rule=self.input_kwargs["scale_rule"], err=self.input_kwargs["err"])
        sink = self.trace_guide.sink
        if which == 0:
            xq = gemm.quantize_activations(x, **kw)
            if rows is not None:  # x: the tokens; quantized once each, then gathered (per row: same bytes)
                sink.write(key, x, xq)
                return None, tuple(t.index_select(0, rows) for t in xq)
            sink.write(key, x, xq, src=pairs[:, 0].contiguous())  # x: the sorted rows; a token's slot-0 row
            return x, xq
        if silu:  # a = bf16(bf16(silu(gate)) * up) and Q(a) in one launch, as packed_gemm's W4A4 path
            a, xq = fused.silu_mul(x, quant=kw, write_y=True)
        else:
            a, xq = x, gemm.quantize_activations(x, **kw)
        sink.write(key, a, xq, src=pairs.reshape(-1), lead=tuple(pairs.shape))
        return a, xq

    def gate_up(self, xs, offsets, tokens: int | None = None, rows: torch.Tensor | None = None,
                pairs: torch.Tensor | None = None):
        """[M, 2I] for the expert-sorted rows xs [M, H], or with rows (int32 [M]) for xs[rows] (xs: the
        tokens; the grouped mma16 kernel reads those rows itself). pairs [n, k]: the sorted row of each
        (token, slot) pair (TRACE records by token and slot)."""
        return self._run(0, xs, offsets, tokens, rows, pairs=pairs)

    def down(self, a, offsets, tokens: int | None = None, silu: bool = False,
             pairs: torch.Tensor | None = None):
        """[M, H] for the sorted rows a [M, I]; silu: a is gate_up's [M, 2I] and the input is
        bf16(bf16(silu(gate)) * up) (fused.silu_mul's bits; W4A16: in the grouped kernel's x staging where it
        runs, gemm.gemm(silu=); W4A4: silu_mul quantizes it in the same launch). pairs: as gate_up's."""
        return self._run(1, a, offsets, tokens, silu=silu, pairs=pairs)


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

    trace_guide = None  # BF16 experts quantize nothing: never guided (pairs= is for _PackedExperts' TRACE)

    def refresh(self) -> None:
        pass

    def gate_up(self, xs, offsets, tokens: int | None = None, rows: torch.Tensor | None = None, pairs=None):
        if rows is not None:
            xs = xs.index_select(0, rows)
        return torch._grouped_mm(xs, self.gu_t, offs=offsets[1:])

    def down(self, a, offsets, tokens: int | None = None, silu: bool = False, pairs=None):
        if silu:
            from fp4rl.kernels import fused

            a, _ = fused.silu_mul(a)
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


FUSED_ROUTE = os.environ.get("FP4RL_MOE_ROUTE", "1") != "0"  # KernelMoeBlock's route/combine kernels
FUSED_GATHER = os.environ.get("FP4RL_MOE_GATHER", "1") != "0"  # the grouped mma16 kernel reads x[rows] itself
# The router GEMM inside the route's launch (moe_route.router_route) up to ROUTER_MAX_TOKENS tokens
# (FP4RL_MOE_ROUTER=0: never; FP4RL_MOE_ROUTER_MAX: another bound, for A/B). On an H200 (E 128, H 2048,
# top 8; bench/RESULTS.md, fourteenth session), with the router split over 256-column slices: 6.9 / 8.1 /
# 25.0 us at 1 / 8 / 32 tokens against 8.3 / 9.3 / 17.2 for cuBLAS's F.linear + the route kernel;
# Qwen3-30B-A3B's step at batch 1 2.44 -> 2.33 ms (W4A16) and 4.91 -> 4.73 ms (BF16), batch 8 4.29 -> 4.28 /
# 11.97 -> 11.89, batch 32 7.50 -> 8.59 / 21.51 -> 22.42 (hence the bound).
FUSED_ROUTER = os.environ.get("FP4RL_MOE_ROUTER", "1") != "0"
ROUTER_MAX_TOKENS = int(os.environ.get("FP4RL_MOE_ROUTER_MAX", "8"))
# Within that bound, the router + route as one CUDA cluster launch (fp4rl.kernels.moe_route_cuda) where its
# plan takes the router, instead of the Triton router_route: the route in warp-wide reductions, without the
# Triton grid's serial last program. Qwen3-30B-A3B W4A16, step ms at batch 1 / 2 / 4 / 8: 1.961 / 2.503 /
# 3.081 / 4.252 against 2.115 / 2.642 / 3.151 / 4.236 (thirty-sixth session, bench/device_run109.sh): 2.20x ->
# 2.37x BF16 at batch 1, even at 8. FP4RL_MOE_ROUTER_CUDA=0 turns it off.
ROUTER_CUDA = os.environ.get("FP4RL_MOE_ROUTER_CUDA", "1") != "0"
# ... up to this many tokens, where it was faster; FP4RL_MOE_ROUTER_CUDA_MAX
ROUTER_CUDA_MAX_TOKENS = int(os.environ.get("FP4RL_MOE_ROUTER_CUDA_MAX", "4"))


class KernelMoeBlock(SparseMoeBlock):
    """SparseMoeBlock whose routed experts run as grouped GEMMs (`plan`), with no host sync. At decode sizes
    (fp4rl.kernels.moe_route.fits) the route (softmax, top-k, weights, the stable grouping by expert) is one
    kernel and the weighted combine another, instead of ~15 torch launches; the grouping and every product
    are `run_experts`', the combine's sum over the k slots is sequential (torch's reduction may add in another
    order: a bf16 ulp), the router probabilities can differ from torch's in their last fp32 bit (see
    moe_route). Up to ROUTER_MAX_TOKENS tokens (FUSED_ROUTER; FP4RL_MOE_ROUTER=0 turns it off) a plain bf16
    router runs inside the route's launch (moe_route.router_route, or with ROUTER_CUDA moe_route_cuda's: its
    logits can differ from cuBLAS's in their last bf16 bit); else the gate module, then the route kernel. The
    grouped mma16 kernel gathers the sorted rows' tokens itself (gemm rows=; FP4RL_MOE_GATHER=0: index_select
    first, the same bits). Routing replay (forced experts), larger batches and FP4RL_MOE_ROUTE=0 take the
    torch route."""

    plan = None
    _router_lock: torch.Tensor | None = None  # router_route's counter, this block's own (set at first use)

    def routed(self, x: torch.Tensor, forced_experts: torch.Tensor | None = None):
        parts = self.routed_parts(x, forced_experts)
        if parts is None:
            return super().routed(x, forced_experts)
        from fp4rl.kernels import moe_route

        d, pos, w, idx = parts
        return moe_route.combine(d, pos, w), idx  # [n, H] in token order

    def routed_parts(self, x: torch.Tensor, forced_experts: torch.Tensor | None = None):
        """The routed experts up to their combine: (d [n k, H] expert outputs in sorted-row order, pos [n k],
        w [n, k], experts [n, k] long), y = moe_route.combine(d, pos, w); or None where the kernels do not
        take this call (then `routed` runs the torch route). The fused decode step folds the combine into the
        next residual add + RMSNorm (fused.add_rmsnorm(moe=))."""
        from fp4rl.kernels import moe_route
        from fp4rl.kernels._common import INTERPRET

        n = x.shape[0]
        if (not FUSED_ROUTE or forced_experts is not None or self.plan is None or x.dtype != KERNEL_DTYPE
                or not (x.is_cuda or INTERPRET) or not moe_route.fits(n, self.top_k, self.num_experts)):
            return None
        gate = self.gate  # a plain bf16 router: its GEMM runs in the route kernel's launch
        if self._plain_router(x):
            _, idx, w, rows, pos, offsets = self._router_route(x, gate.weight)
        else:
            idx, w, rows, pos, offsets = moe_route.route(gate(x), self.top_k, self.norm_topk_prob,
                                                         weight_dtype=x.dtype)
        return self._experts(x, idx, w, rows, pos, offsets)

    def _plain_router(self, x: torch.Tensor) -> bool:
        """Whether the router is a plain bf16 GEMM that runs inside the route's launch (FUSED_ROUTER, up to
        ROUTER_MAX_TOKENS tokens)."""
        gate = self.gate
        return (FUSED_ROUTER and x.shape[0] <= ROUTER_MAX_TOKENS
                and type(gate) in (nn.Linear, PrepackedLinear) and gate.bias is None
                and gate.weight.dtype == x.dtype and gate.weight.stride(-1) == 1)

    def _cuda_router(self, x: torch.Tensor) -> bool:
        """Whether the router + route of x runs as the CUDA cluster launch (ROUTER_CUDA, up to
        ROUTER_CUDA_MAX_TOKENS tokens, where it runs here and its plan takes the router)."""
        from fp4rl.kernels import moe_route_cuda

        n, h = x.shape
        return (ROUTER_CUDA and n <= ROUTER_CUDA_MAX_TOKENS and moe_route_cuda.available(x.device)
                and moe_route_cuda.aligned(self.gate.weight)
                and moe_route_cuda.plan(n, self.top_k, self.num_experts, h) is not None)

    def norm_routed_parts(self, x: torch.Tensor, h: torch.Tensor, norm):
        """The decode step's residual add + RMSNorm `norm` of x + h and the router + route in one CUDA launch
        (moe_route_cuda.norm_router_route), then the routed experts: (x', y, routed_parts' tuple), y =
        norm(x'); or None where that launch does not take this call (the caller runs fused.add_rmsnorm and
        routed_parts; a failure outside a graph capture turns this launch off with a warning, not the CUDA
        router + route)."""
        from fp4rl.kernels import moe_route, moe_route_cuda
        from fp4rl.kernels._common import INTERPRET

        n = x.shape[0]
        w = norm.weight
        if (not FUSED_ROUTE or self.plan is None or x.dtype != KERNEL_DTYPE or not (x.is_cuda or INTERPRET)
                or not moe_route.fits(n, self.top_k, self.num_experts) or not self._plain_router(x)
                or not self._cuda_router(x) or not moe_route_cuda.norm_available(x.device)
                or h.shape != x.shape or h.dtype != x.dtype or w.dtype != x.dtype or not w.is_contiguous()
                or w.data_ptr() % 16):
            return None
        try:
            xs, y, _, idx, tw, rows, pos, offsets = moe_route_cuda.norm_router_route(
                x, h, w, norm.eps, self.gate.weight, self.top_k, self.norm_topk_prob, weight_dtype=x.dtype)
        except Exception as exc:  # noqa: BLE001 - compile / launch failure here: the two launches from now on
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise  # the eager warm-up runs before each capture; a failure here fails the capture
            moe_route_cuda.disable_norm(exc)  # (router_route, the default, stays on)
            return None
        return xs, y, self._experts(y, idx, tw, rows, pos, offsets)

    def _experts(self, x, idx, w, rows, pos, offsets):
        """routed_parts' experts of the routed tokens x: (d, pos, w, idx)."""
        n = x.shape[0]
        pairs = pos.view(n, self.top_k)  # the sorted row of each (token, slot): TRACE's guidance order
        if FUSED_GATHER:  # [n k, 2I]: x[rows], the sorted rows
            gu = self.plan.gate_up(x, offsets, tokens=n, rows=rows, pairs=pairs)
        else:
            gu = self.plan.gate_up(x.index_select(0, rows), offsets, tokens=n, pairs=pairs)
        # down_proj of bf16(bf16(silu(gate)) * up) (torch's bits on the GPU), the SiLU fused where it can be
        return self.plan.down(gu, offsets, tokens=n, silu=True, pairs=pairs), pos, w, idx

    def _router_route(self, x: torch.Tensor, weight: torch.Tensor):
        """The plain bf16 router and the route in one launch: the CUDA kernel (ROUTER_CUDA, up to
        ROUTER_CUDA_MAX_TOKENS tokens, where it runs and its plan takes the router; a failure outside a graph
        capture turns it off with a warning) or the Triton router_route on this block's own counter."""
        from fp4rl.kernels import moe_route, moe_route_cuda

        if self._cuda_router(x):
            try:
                return moe_route_cuda.router_route(x, weight, self.top_k, self.norm_topk_prob,
                                                   weight_dtype=x.dtype)
            except Exception as exc:  # noqa: BLE001 - compile / launch failure here: the Triton kernel from now
                if x.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise  # the eager warm-up runs before each capture; a failure here fails the capture
                moe_route_cuda.disable(exc)
        lock = self._router_lock
        if lock is None or lock.device != x.device:  # two samplers' blocks never share one
            lock = self._router_lock = torch.zeros(1, dtype=torch.int32, device=x.device)
        return moe_route.router_route(x, weight, self.top_k, self.norm_topk_prob, weight_dtype=x.dtype,
                                      lock=lock)

    def run_experts(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        if self.plan is None or x.dtype != KERNEL_DTYPE:
            return super().run_experts(x, topk_idx, topk_weight)
        n, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        ids = torch.arange(self.num_experts + 1, device=x.device)
        offsets = torch.searchsorted(flat[order], ids).to(torch.int32)  # [E + 1] start of each expert
        xs = x.index_select(0, order // k)  # [n k, H]
        pairs = None
        if self.plan.trace_guide is not None:  # the sorted row of each (token, slot) pair
            pairs = torch.empty_like(order).index_copy_(0, order, torch.arange(n * k, device=x.device))
            pairs = pairs.view(n, k)
        gu = self.plan.gate_up(xs, offsets, tokens=n, pairs=pairs)  # [n k, 2I]
        i = gu.shape[-1] // 2
        d = self.plan.down(F.silu(gu[:, :i]) * gu[:, i:], offsets, tokens=n, pairs=pairs)  # [n k, H]
        out = torch.empty_like(d).index_copy_(0, order, d).view(n, k, -1)  # back to (token, slot) order
        return (out.float() * topk_weight.float()[..., None]).sum(1).to(x.dtype)

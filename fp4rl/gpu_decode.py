"""The sampler on a GPU: Triton NVFP4 kernels in its modules, a static KV cache, CUDA graphs for decode.

`Sampler(..., kernels=True)` (the default on CUDA in bfloat16) builds a `DecodeEngine` over the
sampler's own model copy. What it changes, and what it computes:

- Linears, fused groups and routed experts run the GPU kernels through the modules of
  `fp4rl.gpu_linear` (swapped in by `attach_kernels`; their decode copies are refreshed before every
  capture and `generate`).
- KV cache: one static cache (`fp4rl.kvcache` classes, B_cap rows x T_cap slots) reused across
  `generate` calls; prefill writes it through prefix views, the n-fold copy of a prompt's rows and
  the compaction of finished rows are done in place. A decode step writes its token's K/V at one
  slot (NVFP4: quantized per (row, head), byte-identical to the CPU cache's quantizer, by the fused step's
  q/k-norm + RoPE kernel, `FUSED_KV_FP4`, else by `kernels.quantize` in fp4rl.decode_kv.store_kv; FP8: by
  that kernel too, with the bytes of the cache's own torch quantizer, which store_kv runs otherwise) and
  attends with `kernels.attention.decode_attention` over [first real token, slot] of each row (left
  padding skipped); so does the BF16 cache (the kernel's bf16 branch, head_dim a power of two >= 16; else,
  or with `BF16_ATTENTION` / FP4RL_BF16_ATTENTION=0: SDPA over all T_cap slots with a mask).
- Fused decode step (`FUSED`, `DecodeEngine(fused=...)`, `set_fused` for A/B): the elementwise work between
  the GEMMs runs as fp4rl.kernels.fused kernels, four per layer plus one for the final norm: residual add +
  RMSNorm before attention and before the MLP, q/k-norm + RoPE + the write of k/v into the BF16, NVFP4 or FP8
  cache slot, SiLU(gate) * up (in a W4A16 gate/up group's GEMM epilogue where its mma16 launch has the GU_SILU
  build: `_Site.silu_run`, FP4RL_GU_SILU=0 for A/B; same bits). Where the consumer is a W4A4 linear or fused
  group (q/k/v, gate/up, down_proj), the producer kernel also quantizes its output per token with the shared
  quantizer's own helpers (the bytes of `kernels.quantize` for the same input) and the GEMM takes that Q(x)
  (`packed_gemm(..., xq=)`, `gemm.gemm`'s pre-quantized entry); o_proj (after attention) still quantizes its
  input itself. Same arithmetic as the modules, bit for bit except the norms' rstd (fp32 sum of squares added
  in another order, Triton's rsqrt: y can move by one bfloat16 ulp, see fused.py). `fused_plans`
  (fp4rl/decode_plan.py) decides per layer: q/k/v that are not one fused group, MoE and unfused MLPs run their
  modules on the norm's bf16 output (a layer that falls back launches fewer fused kernels). An MoE layer on
  the route kernels (`KernelMoeBlock.routed_parts`: router GEMM, route kernel, gate/up's GEMM with the gather
  inside, down's with SiLU * up inside at decode sizes) hands its expert outputs to the next residual add +
  RMSNorm, which does the weighted combine itself (`fused.add_rmsnorm(moe=)`; a shared expert's term is its
  h), up to COMBINE_MAX_TOKENS rows: four launches per MoE MLP (router GEMM, route, gate/up, down) where the
  torch path takes ~20 (`FUSED_COMBINE` / FP4RL_MOE_COMBINE=0, and gpu_experts' FUSED_ROUTER (up to
  ROUTER_MAX_TOKENS) / FUSED_GATHER, gemm.FUSED_SILU for A/B). Two flags, off (slower when timed), fold an add
  + RMSNorm into the launch that consumes it (fp4rl.kernels.prenorm's arithmetic): ROUTER_NORM (an MoE layer's
  post-attention norm in the CUDA router + route), DENSE_NORM (a dense layer's two in its W4A16 q/k/v and
  gate/up mma16 GEMMs, an MoE layer's input one with the previous combine in its q/k/v GEMM: the sites'
  `norm_run`, gpu_linear.prenorm_gemm). With either on, every add_rmsnorm of the step sums in those builds'
  order (`prenorm_order`), so a norm gives the same bits folded or not (batch buckets the builds do not plan).
  A third, RESNORM (FP4RL_RESNORM=1), splits a dense layer's add + RMSNorm over the W4A16 GEMMs on either side
  instead (fp4rl.kernels.resnorm): o_proj / down_proj's epilogue writes x', w x' and tile sums of squares, the
  next q/k/v or gate/up multiplies its sums by rstd, where both mma16 launches have the RN builds (x staged
  whole: one row on the Qwen3 shapes); within bf16 rounding of the module step, not its bits.
- CUDA graphs: one graph per batch bucket (powers of two up to B_cap; and per TRACE guidance fraction,
  `set_guidance`: a guided step also records guidance, fp4rl/gpu_trace.py), captured on first use
  after an eager warm-up step on a side stream (Triton compiles and the GEMM tuner runs there,
  never during capture), replayed for every decode step of that bucket. Inputs (tokens, RoPE
  positions, first real slot per row, current length) are copied into static buffers; rows past
  the live batch in a bucket compute on stale data nobody reads. The step has no host sync
  (quantize with check_finite=False, routing sorted on the device). If capture fails the engine
  warns once, records why (`graph_error`) and decodes eagerly with the same code (until `set_fused`
  switches the step, which then gets its own capture; one failure, guided or not, stops every graph).
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from fp4rl.batch import ROUTING_DTYPE
from fp4rl.decode_kv import attend_fp8, attend_nvfp4, attend_quantized
from fp4rl.decode_plan import _records, _Site, fused_plans
from fp4rl.gpu_experts import KernelMoeBlock  # noqa: F401  (re-exported for callers of gpu_decode)
from fp4rl.gpu_linear import (  # noqa: F401  (the engine's modules; re-exported for callers of gpu_decode)
    KERNEL_DTYPE,
    KernelFusedGroup,
    KernelPackedLinear,
    attach_kernels,
    decode_copy_bytes,
    dense_copy_bytes,
    kernel_ready,
    packed_gemm,
)
from fp4rl.kernels import pdl, step_inputs
from fp4rl.kernels._common import INTERPRET
from fp4rl.kvcache import make_kv_cache
from fp4rl.model import CausalLM, ModelConfig, rotate_half

SLOT_ALIGN = 64  # T_cap is rounded up to this
FUSED = True  # new engines run the fused decode step (fp4rl.kernels.fused); DecodeEngine.set_fused for A/B
# the fused step folds an MoE layer's combine into the next residual add + RMSNorm (fused.add_rmsnorm(moe=))
FUSED_COMBINE = os.environ.get("FP4RL_MOE_COMBINE", "1") != "0"
# ... up to this many rows per step: each of a row's add_rmsnorm programs gathers the row's k expert outputs
# in every pass over it, and with it (and the router kernel) on, the Qwen3-30B-A3B graph replay at batch 32
# read 8.78 ms on an H200 against 7.80 in the session before (BF16 22.06 against 21.37; bench/RESULTS.md,
# eleventh session): not yet separated by an A/B, so larger batches keep the combine kernel
COMBINE_MAX_TOKENS = int(os.environ.get("FP4RL_MOE_COMBINE_MAX", "8"))  # (FP4RL_MOE_COMBINE_MAX: for A/B)
# a BF16 cache is read by the Triton decode kernel (kernels.attention: [start, length) of each row only),
# not by SDPA over all T_cap slots with a mask (FP4RL_BF16_ATTENTION=0)
BF16_ATTENTION = os.environ.get("FP4RL_BF16_ATTENTION", "1") != "0"
# the fused step writes an NVFP4 or FP8 cache in its q/k-norm + RoPE kernel (quantized per (row, head) there:
# the bytes of decode_kv.store_kv) instead of its quantize and scatter launches (FP4RL_FUSED_KV=0 for A/B; the
# FP8 cache's torch quantizer and writes are ~26 small launches a layer: with them Qwen3-8B at 4K context,
# batch 1, was 41% slower than with the BF16 cache on an H100, forty-ninth session)
FUSED_KV_FP4 = os.environ.get("FP4RL_FUSED_KV", "1") != "0"
# the fused step's q/k-norm + RoPE, BF16-cache write and attention in one launch
# (kernels.attention.decode_attention_rope) instead of qk_norm_rope, then the attention kernel; off: 2.8%
# slower at batch 1 on an H100 (FP4RL_ATTN_ROPE=1; bench/RESULTS.md, thirty-eighth session)
ATTN_ROPE = os.environ.get("FP4RL_ATTN_ROPE", "0") == "1"
# an MoE layer's post-attention residual add + RMSNorm inside the CUDA router + route's launch
# (KernelMoeBlock.norm_routed_parts, moe_route_cuda.norm_router_route) instead of fused.add_rmsnorm's launch
# before it, where that launch takes the layer (up to gpu_experts.ROUTER_CUDA_MAX_TOKENS rows, W4A16 or BF16
# activations into the experts: a W4A4 expert quantizes y inside its grouped GEMM);
# off: no faster at batch 1 on an H100 (FP4RL_MOE_ROUTER_NORM=1; bench/RESULTS.md, thirty-eighth session)
ROUTER_NORM = os.environ.get("FP4RL_MOE_ROUTER_NORM", "0") == "1"
# the residual add + RMSNorm before a dense W4A16 q/k/v or gate/up inside its mma16 GEMM's launch (the site's
# norm_run: gpu_linear.prenorm_gemm, gemv_cuda_prenorm.launch_prenorm) instead of fused.add_rmsnorm's launch:
# two launches fewer a dense layer, one an MoE layer (its input norm with the previous layer's combine folded
# in, where it has no shared expert); off: 3-6% slower at batch 1 on an H100, the norm costing more inside
# each GEMM CTA than the launch it removes (FP4RL_DENSE_NORM=1; bench/RESULTS.md, thirty-eighth session)
DENSE_NORM = os.environ.get("FP4RL_DENSE_NORM", "0") == "1"
# the residual add + RMSNorm between two dense W4A16 GEMMs split over them (fp4rl.kernels.resnorm; the mma16
# RN_OUT / RN_IN builds where both take the batch: the in-CTA split, one row on the Qwen3 shapes): o_proj /
# down_proj's epilogue writes x', w * x' and tile sums of squares, the next q/k/v or gate / up multiplies its
# sums by rstd; no add_rmsnorm launch between. Within bf16 rounding of the module step, not its bits
# (FP4RL_RESNORM=1; off until measured)
RESNORM = os.environ.get("FP4RL_RESNORM", "0") == "1"


def _pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _rn_pair(prod: _Site | None, cons: _Site | None, quant: dict | None, bb: int, device) -> bool:
    """RESNORM: whether the norm between prod's GEMM and cons's runs split over the two launches (both kernel
    sites take it at bb rows, the consumer W4A16 and not recording)."""
    return (RESNORM and prod is not None and cons is not None and prod.rn is not None and cons.rn is not None
            and quant is None and not _records(cons) and not _records(prod)
            and prod.rn.rn_takes(bb, device, out=True) and cons.rn.rn_takes(bb, device, out=False))


# ----------------------------------------------------------------------------------------------
# The fused step's DENSE_NORM fold (the plan itself: fp4rl.decode_plan)


def _dense_norm(site: _Site | None, quant: dict | None, x, h, norm, moe: dict):
    """DENSE_NORM: (x', the site's output on norm(x')) from one launch (site.norm_run), x' = x + h or, with
    the previous MoE layer's combine to fold (moe, h None: no shared expert), x + combine; None where it does
    not apply (flag off, nothing to add, a combine and a shared expert's h, a W4A4 or recording site) or the
    kernel does not take the call: then add_rmsnorm and site.run."""
    if (not DENSE_NORM or site is None or site.norm_run is None or quant is not None or _records(site)
            or (h is None) == (not moe)):
        return None
    return site.norm_run(x, h, norm, moe.get("moe"))


# ----------------------------------------------------------------------------------------------
# The decode engine


class DecodeEngine:
    """Static KV cache + one decode step per batch bucket, replayed from CUDA graphs (see module doc)."""

    def __init__(self, model: CausalLM, *, graphs: bool = True, fused: bool | None = None,
                 dense_rows: int = 0):
        dtype = model.model.embed_tokens.weight.dtype
        if dtype != KERNEL_DTYPE:
            raise ValueError(f"Sampler kernels=True needs dtype=torch.bfloat16 (the kernels' activations), "
                             f"got {dtype}; pass dtype=torch.bfloat16 or kernels=False")
        self.model = model
        self.config: ModelConfig = model.config
        self.device = model.model.embed_tokens.weight.device
        self.graphs_enabled = graphs and self.device.type == "cuda"
        self.refreshable = attach_kernels(model, dense_rows)
        self.plans = fused_plans(model)  # None: the fused step does not cover this model
        self.fused = (FUSED if fused is None else fused) and self.plans is not None
        self.static = None  # the SamplerKVCache all generate calls write into
        self.rope = None  # RoPE's (cos, sin) rows by position, [T_cap, 2, D] (_rope_table)
        # the step's inputs into the static buffers: one launch where the kernels run, else seven torch ops
        kernels = self.device.type == "cuda" or INTERPRET
        self._write_inputs = step_inputs.write if kernels else step_inputs.reference
        self._record = step_inputs.record if kernels else step_inputs.record_reference
        self.route = None  # the routing record [L_moe, b_cap, t_cap, k] the steps write (see routing)
        self.graphs: dict[tuple, tuple] = {}  # graph_key -> (CUDAGraph, outputs, workspaces kept alive)
        self.graph_error: str | None = None
        self.pool = None
        self.counts = {"replays": 0, "eager_steps": 0, "captures": 0}
        self.attention_error: str | None = None  # why the BF16-cache attention kernel was given up, if it was
        self.attn_rope_error: str | None = None  # why the one-launch q/k-norm + RoPE + attention was given up
        self.guidance = 0.0  # TRACE: the deep fraction whose guidance every forward records (0: none)
        self.sink = None  # its gpu_trace.GuideSink
        self._step_guidance = None  # the last decode step's (take_guidance)

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
            self.rows = torch.full((b_cap,), -1, dtype=torch.long, device=dev)  # the record's row per row
            self.route = None
            if self.config.moe_layers:  # (int16: 2 B per layer and expert of a slot; its KV ~36-100x more)
                k = self.config.num_experts_per_tok
                self.route = torch.zeros(len(self.config.moe_layers), b_cap, t_cap, k, dtype=ROUTING_DTYPE,
                                         device=dev)
            self._rope_table(t_cap)
        for r in self.refreshable:  # weight sync may have written new global scales
            r.refresh()
        view = copy.copy(self.static)
        self._narrow(view, rows)
        view.length = 0
        view.select = lambda idx, view=view: self._select(view, idx)
        return view

    def routing(self, rows: int, total: int) -> torch.Tensor | None:
        """The routing record of a generate of `rows` rows and `total` slots, zeroed: [L_moe, rows, total,
        k] ROUTING_DTYPE, a view of the engine's buffer (None without MoE layers; after new_cache, which
        sizes it). decode(..., rows=r) writes each step's experts into it at [:, r[i], positions[i]] (one
        launch): valid until the next new_cache."""
        if self.route is None:
            return None
        if rows > self.route.shape[1] or total > self.route.shape[2]:
            raise ValueError(f"routing: {rows} rows of {total} slots for a cache of {self.route.shape[1]} "
                             f"rows of {self.route.shape[2]} slots; call new_cache with the generate's sizes "
                             "first")
        view = self.route[:, :rows, :total]
        view.zero_()
        return view

    def _rope_table(self, t_cap: int) -> None:
        """RoPE's (cos, sin) for every position a step can see, [t_cap, 2, D] in the activations' dtype, so a
        step gathers its rows in one launch instead of computing them (seven launches: the cast, the angles,
        the cat, cos, sin, two casts). A position counts its row's real tokens, so it is below the cache's
        slots (decode's contract). Built on the device by model.rope_tables itself: elementwise, so each row
        has the bits the per-step computation gives."""
        if self.rope is None or self.rope.shape[0] < t_cap:
            m = self.model.model
            cos, sin = m.rope_tables(torch.arange(t_cap, device=self.device), m.embed_tokens.weight.dtype)
            self.rope = torch.stack((cos, sin), dim=1)  # [t_cap, 2, D]

    def _rope_rows(self, bb: int):
        """This step's RoPE rows: (cos, sin), each [bb, D] (views of one gathered [bb, 2, D])."""
        cs = self.rope.index_select(0, self.positions[:bb])
        return cs[:, 0], cs[:, 1]

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
    def decode(self, view, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
               rows: torch.Tensor | None = None, advance: bool = False):
        """Next-token logits [b, V] and the experts chosen ([L_moe, b, 1, k] ROUTING_DTYPE, stacked inside
        the step's graph; None without MoE layers) for one new token per row; mask [b, length + 1] is the
        sampler's (left padding, then real tokens), its last column (the new token's slot) set to 1 here;
        positions [b] count each row's real tokens before this one, so they are below length + 1 (the RoPE
        table covers the cache's slots). rows [b] (int64): the experts are recorded in `routing`'s view at
        [:, rows[i], positions[i]] (one launch after the step). advance: positions += 1 in place (the next
        step's). (With the kernels the inputs, the mask's column and the advance are one launch:
        step_inputs.)"""
        b, slots = tokens.numel(), mask.shape[1]
        if slots != view.length + 1 or slots > self.static.max_len or b != view.batch_size:
            raise ValueError(f"decode: mask covers {slots} slots for a cache of {view.length} used, "
                             f"{self.static.max_len} slots, {view.batch_size} rows (got {b} tokens)")
        if rows is not None and self.route is None:
            raise ValueError("decode: rows given for a model without MoE layers (no routing to record)")
        self._write_inputs(tokens, positions, mask, self.tokens, self.positions, self.starts, self.lengths,
                           self.slot, self.rows, rows, advance)
        bucket = self.bucket(b)
        key = self.graph_key(bucket)
        out = None
        if self.graphs_enabled and self.graph_error is None:
            out = self.graphs[key][1] if key in self.graphs else self._capture(bucket)
            if out is not None:
                self.graphs[key][0].replay()
                self.counts["replays"] += 1
        if out is None:
            out = self._step(bucket)
            self.counts["eager_steps"] += 1
        view.length = slots
        logits, chosen, guidance = out
        if rows is not None:  # rows[i] -1 past b: nothing recorded for a bucket's padding rows
            self._record(chosen, self.rows[:bucket], self.positions[:bucket], self.route)
        self._step_guidance = None if guidance is None else (*guidance, b)
        return logits[:b], None if chosen is None else chosen[:, :b]

    def bucket(self, batch: int) -> int:
        """The rows a step of `batch` rows runs on: next power of two, at most the static buffers' rows."""
        return min(_pow2(batch), self.static.batch_size)

    def graph_key(self, bucket: int) -> tuple:
        """The key of `graphs` for a batch bucket: a guided step records guidance, a graph of its own."""
        return bucket, self.guidance

    # -- TRACE guidance --------------------------------------------------------------------------
    def set_guidance(self, deep_fraction: float) -> None:
        """Record TRACE guidance of the W4A4 linears in the deepest `deep_fraction` of the layers
        (fp4rl.trace.guided_modules) in every forward from now on, prefill and decode (0: stop). A guided
        decode step is captured as its own graph per batch bucket (switching back and forth recaptures
        nothing); in the fused step its norm and SiLU kernels then also write the bf16 x whose Q(x) they
        hand a guided site (the guidance's amax is x's)."""
        from fp4rl import gpu_trace

        deep_fraction = float(deep_fraction or 0.0)
        if self.sink is not None:
            self.sink.take()  # (guidance of a forward nobody took, e.g. one that failed: not the next one's)
        self._step_guidance = None
        if deep_fraction != self.guidance:
            self.sink, self.guidance = None, 0.0  # (attach takes every Guide away first, even if it fails)
            self.sink = gpu_trace.attach(self.model, deep_fraction)
            self.guidance = deep_fraction

    def take_guidance(self) -> tuple | None:
        """The guidance of the last forward, packed (gpu_trace.pack): (flat uint8 device tensor, layout,
        rows), rows None for every row; a decode step's (its live rows: b of the bucket's; a graph's static
        output, which the next step overwrites) or, after a prefill through the engine's modules, the
        prefill's. None if there is none."""
        from fp4rl import gpu_trace

        if self.sink is None:
            return None
        got = self.sink.take()
        if got:
            return (*gpu_trace.pack(got), None)
        step, self._step_guidance = self._step_guidance, None
        return step

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
            # thread_local: an async run captures in its rollout thread while the trainer's thread allocates
            # and syncs (.item()); "global" (torch's default) would forbid those in every thread meanwhile
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._step(bucket)
        except Exception as exc:  # noqa: BLE001 - any capture failure: decode eagerly, say why
            step = "fused" if self.fused else "module"
            self.graph_error = f"{step} step, batch bucket {bucket}: {type(exc).__name__}: {str(exc)[:300]}"
            warnings.warn(f"CUDA graph capture failed ({self.graph_error}); decoding eagerly", stacklevel=3)
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.device)
            return None
        self.graphs[self.graph_key(bucket)] = (graph, out, keep)
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
            self.reset_graphs()
        return self.fused

    def reset_graphs(self) -> None:
        """Drop the captured graphs and a capture failure: the next step of each bucket recaptures (after
        switching something a graph bakes in, e.g. programmatic dependent launch, fp4rl.kernels.pdl)."""
        self.graphs.clear()
        self.pool = None
        self.graph_error = None

    def _step(self, bb: int):
        """The decode step on the static buffers' first bb rows (what a graph captures)."""
        from fp4rl import gpu_trace

        if self.sink is not None:
            self.sink.take()  # (left by a forward whose guidance nobody took)
        with pdl.step():  # programmatic dependent launches between the step's kernels (kernels/pdl.py)
            logits, chosen = self._step_fused(bb) if self.fused else self._step_modules(bb)
            # one [L_moe, bb, 1, k] tensor in the routing record's dtype: decode writes it into the routing
            # record with one launch after the step (not inside the graph: with it there the 30B's replay
            # measured slower, bench/RESULTS.md, forty-first session)
            stacked = torch.stack(chosen).to(ROUTING_DTYPE) if chosen else None
            # TRACE: the step's guidance packed into one tensor (a graph output; one copy to the host)
            guidance = gpu_trace.pack(self.sink.take()) if self.sink is not None else None
            return logits, stacked, guidance

    def _step_fused(self, bb: int):
        """_step_modules' arithmetic in fused kernels (fp4rl.kernels.fused): per layer one residual-add +
        RMSNorm kernel before attention and one before the MLP, one q/k-norm + RoPE (+ bf16 KV write)
        kernel, one SiLU * up kernel; a W4A4 q/k/v, gate/up or down_proj takes its Q(x) from that kernel.
        Layers (or halves) the plan does not cover run their modules on the norm's bf16 output."""
        from fp4rl.kernels import fused

        m = self.model.model
        x = m.embed_tokens(self.tokens[:bb])  # [bb, H]
        cos, sin = self._rope_rows(bb)  # [bb, D] each
        ctx = self._context(bb)
        h, chosen, moe = None, [], {}
        # with a norm folded into another launch (ROUTER_NORM / DENSE_NORM) every norm of the step sums in
        # the PRENORM builds' order: the same bits whether a bucket's norm is folded or not
        order = {"prenorm_order": True} if ROUTER_NORM or DENSE_NORM else {}
        pend = None  # RESNORM: (xt, ss), this layer's input norm split over the last down_proj and q/k/v
        for li, (layer, p) in enumerate(zip(m.layers, self.plans)):
            norm = layer.input_layernorm
            if pend is not None:  # the norm's second half in the q/k/v launch
                qkv, pend = p.qkv.rn.rn_in(*pend, norm.eps), None
            elif (qkv := _dense_norm(p.qkv, p.in_quant, x, h, norm, moe)) is not None:
                x, qkv = qkv  # (DENSE_NORM: the norm in the GEMM)
            else:
                # (TRACE: a guided W4A4 site records its Q(x)'s guidance, and needs x too: its amax)
                x, n, nq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=p.in_quant,
                                             write_y=p.in_quant is None or _records(p.qkv), **moe, **order)
                qkv = p.qkv.run(n, nq) if p.qkv is not None else None
            moe = {}
            norm = layer.post_attention_layernorm
            rn = None  # RESNORM: (x', xt, ss) from o_proj's launch, the post-attention norm's first half
            if qkv is not None:
                y = self._attention_fused(layer.self_attn, qkv, cos, sin, ctx, bb)  # [bb, H D], before o_proj
                if p.gate_up is not None and _rn_pair(p.o, p.gate_up, p.post_quant, bb, y.device):
                    rn = p.o.rn.rn_out(y, x, norm)  # (None: the kernel failed, add_rmsnorm from now on)
                h = layer.self_attn.o_proj(y[:, None])[:, 0] if rn is None else None
            else:
                h = self._attention(layer.self_attn, n[:, None], cos[:, None, None], sin[:, None, None], ctx,
                                    bb)[:, 0]
            fold = (layer.is_moe and FUSED_COMBINE and bb <= COMBINE_MAX_TOKENS
                    and isinstance(layer.mlp, KernelMoeBlock))
            pre = gu = a = None
            if rn is not None:  # the norm's second half in the gate/up launch (SiLU * up there too, if taken)
                x, xt, ss = rn
                if p.down.quant is None:
                    a, aq = p.gate_up.rn.rn_in(xt, ss, norm.eps, silu_out=True), None
                else:
                    gu = p.gate_up.rn.rn_in(xt, ss, norm.eps)
            else:
                if ROUTER_NORM and fold and p.post_quant is None:  # the norm inside the router's launch
                    pre = layer.mlp.norm_routed_parts(x, h, norm)
                elif p.gate_up is not None:  # (DENSE_NORM: the norm inside the gate/up GEMM's launch)
                    gu = _dense_norm(p.gate_up, p.post_quant, x, h, norm, {})
                if pre is not None:
                    (x, n, parts), nq = pre, None
                elif gu is not None:
                    x, gu = gu
                else:
                    x, n, nq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=p.post_quant,
                                                 write_y=p.post_quant is None or _records(p.gate_up), **order)
            if p.gate_up is not None:
                if a is None and gu is None and p.down.quant is None and p.gate_up.silu_run is not None:
                    a, aq = p.gate_up.silu_run(n), None  # SiLU * up in the gate/up launch (where taken)
                elif a is None:
                    a, aq = fused.silu_mul(gu if gu is not None else p.gate_up.run(n, nq), quant=p.down.quant,
                                           write_y=p.down.quant is None or _records(p.down))
                nxt = self.plans[li + 1] if li + 1 < len(self.plans) else None
                if (aq is None and nxt is not None
                        and _rn_pair(p.down, nxt.qkv, nxt.in_quant, bb, a.device)):
                    rn = p.down.rn.rn_out(a, x, m.layers[li + 1].input_layernorm)  # next input norm's half
                    if rn is not None:
                        x, xt, ss = rn
                        pend, h = (xt, ss), None
                        continue
                h = p.down.run(a, aq)  # [bb, H]
            elif layer.is_moe:
                if pre is None:
                    parts = layer.mlp.routed_parts(n) if fold else None
                if parts is None:
                    h, experts = layer.mlp(n[:, None])  # experts [bb, 1, k]
                    chosen.append(experts)
                    h = h[:, 0]
                else:  # the combine runs in the next add_rmsnorm; h: SparseMoeBlock.forward's shared term
                    d, pos, w, experts = parts
                    chosen.append(experts[:, None])
                    moe = {"moe": (d, pos, w)}
                    h = layer.mlp.shared(n)
            else:
                h = layer.mlp(n[:, None])[:, 0]
        _, n, _ = fused.add_rmsnorm(x, h, m.norm.weight, m.norm.eps, **moe, **order)
        return self.model.lm_head(n), chosen  # [bb, V]

    def _attention_fused(self, attn, qkv, cos, sin, ctx, bb: int) -> torch.Tensor:
        """Attention of one token per row from the fused q|k|v projection qkv [bb, (H + 2 H_kv) D]: its output
        [bb, H D], o_proj's input (the step runs o_proj: a RESNORM producer or the module)."""
        from fp4rl.kernels import fused

        d, cfg = attn.head_dim, self.config
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        qw = kw = None
        eps = cfg.rms_norm_eps
        if hasattr(attn, "q_norm"):
            qw, kw, eps = attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps
        i, c = attn.layer_idx, self.static
        if c.kind == "bf16" and ATTN_ROPE and ctx.mask is None and self.attn_rope_error is None:
            y = self._attend_rope(qkv, cos, sin, hq, hkv, d, qw, kw, eps, c, i, ctx, bb)
            if y is not None:  # (None: it cannot run here, the two kernels below from now on)
                return y.reshape(bb, -1)
        if c.kind == "bf16":  # k and v go straight to their cache slot
            q, _ = fused.qk_norm_rope(qkv, cos, sin, hq, hkv, d, qw, kw, eps, k_cache=c.k[i], v_cache=c.v[i],
                                      slot=ctx.slot)  # [bb, H, 1, D]
            y = self._attend_bf16(c, i, q, ctx, bb, attn.n_rep)
        elif c.kind == "nvfp4" and FUSED_KV_FP4 and fused.fp4_cache_fits(d):  # quantized into the slot there
            bufs = tuple(getattr(c, name)[i] for name in c.buffer_names)  # k then v: data, scales, global
            q, _ = fused.qk_norm_rope(qkv, cos, sin, hq, hkv, d, qw, kw, eps, slot=ctx.slot, fp4_cache=bufs,
                                      fp4_quant=c.quantize_kwargs)
            y = attend_nvfp4(c, i, q, ctx, bb)
        elif c.kind == "fp8" and FUSED_KV_FP4:  # quantized into the slot there (FP8KVCache.quantize's bytes)
            q, _ = fused.qk_norm_rope(qkv, cos, sin, hq, hkv, d, qw, kw, eps, slot=ctx.slot,
                                      fp8_cache=(c.k[i], c.k_scale[i], c.v[i], c.v_scale[i]))
            y = attend_fp8(c, i, q, ctx, bb)
        else:
            q, k = fused.qk_norm_rope(qkv, cos, sin, hq, hkv, d, qw, kw, eps)
            v = qkv[:, (hq + hkv) * d:].view(bb, hkv, 1, d)
            y = attend_quantized(c, i, q, k, v, ctx, bb)
        return y.reshape(bb, -1)

    def _attend_rope(self, qkv, cos, sin, hq, hkv, d, qw, kw, eps, c, i, ctx, bb):
        """q/k-norm + RoPE, the BF16 cache write and the attention in one launch (ATTN_ROPE) -> [bb, H, D];
        None (and `attn_rope_error`, a warning: the two kernels from now on) where it cannot run here."""
        from fp4rl.kernels.attention import decode_attention_rope

        try:
            return decode_attention_rope(qkv, cos, sin, hq, hkv, d, qw, kw, eps, c.k[i], c.v[i], ctx.slot,
                                         starts=ctx.starts)
        except Exception as exc:  # noqa: BLE001 - compile / launch failure here: the two kernels from now on
            if qkv.is_cuda and torch.cuda.is_current_stream_capturing():
                raise  # the eager warm-up runs before each capture; a failure here fails the capture
            self.attn_rope_error = f"{type(exc).__name__}: {str(exc)[:300]}"
            warnings.warn(f"the one-launch q/k-norm + RoPE + attention kernel failed "
                          f"({self.attn_rope_error}); running qk_norm_rope and the attention kernel from now "
                          "on", stacklevel=2)
            return None

    def _context(self, bb: int) -> SimpleNamespace:
        ctx = SimpleNamespace(lengths=self.lengths[:bb], starts=self.starts[:bb], slot=self.slot, mask=None)
        d = self.config.head_dim
        kernel = BF16_ATTENTION and d >= 16 and d & (d - 1) == 0 and self.attention_error is None
        if self.static.kind == "bf16" and not kernel:
            ctx.mask = self._bf16_mask(ctx)
        return ctx

    def _bf16_mask(self, ctx) -> torch.Tensor:
        """SDPA's additive mask [bb, 1, 1, T_cap] over the BF16 cache: 0 on [start, length), else -inf."""
        key = torch.arange(self.static.max_len, device=self.device)
        visible = (key[None] >= ctx.starts[:, None]) & (key[None] < ctx.lengths[:, None])  # [bb, T_cap]
        # SDPA turns a boolean mask into this additive one (zeros, then -inf where hidden) in every layer's
        # call: built once per step here instead (the same values, so the same attention)
        mask = torch.zeros(visible.shape, dtype=self.static.k[0].dtype, device=self.device)
        return mask.masked_fill_(~visible, float("-inf"))[:, None, None]

    def _step_modules(self, bb: int):
        """The decode step through the model's modules (the unfused path)."""
        m = self.model.model
        x = m.embed_tokens(self.tokens[:bb])[:, None]  # [bb, 1, H]
        cos, sin = self._rope_rows(bb)  # [bb, D] each
        cos, sin = cos[:, None, None], sin[:, None, None]  # [bb, 1, 1, D]
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
            y = self._attend_bf16(c, i, q, ctx, bb, attn.n_rep)
        else:
            y = attend_quantized(c, i, q, k, v, ctx, bb)
        return attn.o_proj(y.reshape(bb, 1, -1))

    def _attend_bf16(self, c, i: int, q, ctx, bb: int, n_rep: int) -> torch.Tensor:
        """Attention of q [bb, H, 1, D] over the BF16 cache's rows [start, length) -> [bb, H, D]: the Triton
        decode kernel (kernels.attention, its bf16 branch), or SDPA with the step's mask (BF16_ATTENTION off,
        head_dim not a power of two >= 16, or the kernel failed here once: `attention_error` says why, and
        the engine warns and stays on SDPA)."""
        if ctx.mask is None:
            from fp4rl.kernels.attention import decode_attention

            try:
                return decode_attention(q[:, :, 0], ctx.lengths, c.k[i][:bb], c.v[i][:bb], starts=ctx.starts)
            except Exception as exc:  # noqa: BLE001 - compile / launch failure here: SDPA from now on
                if q.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise  # the eager warm-up runs before each capture; a failure here fails the capture
                self.attention_error = f"{type(exc).__name__}: {str(exc)[:300]}"
                warnings.warn(f"the BF16-cache decode attention kernel failed ({self.attention_error}); "
                              "attending with SDPA from now on (FP4RL_BF16_ATTENTION=0 skips the kernel)",
                              stacklevel=2)
                ctx.mask = self._bf16_mask(ctx)
        return F.scaled_dot_product_attention(q, c.k[i][:bb], c.v[i][:bb], attn_mask=ctx.mask,
                                              enable_gqa=n_rep > 1)[:, :, 0]

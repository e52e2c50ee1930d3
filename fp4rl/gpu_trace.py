"""TRACE guidance recorded by the kernel engine (fp4rl.gpu_decode), prefill and CUDA-graph decode steps alike.

On the eager path fp4rl.trace.recording patches the guided linears' ``quantize_input``; the engine's
modules (fp4rl.gpu_linear, fp4rl.gpu_experts) quantize elsewhere (``gemm.quantize_activations``, the SiLU
kernel), so there each guided site carries a ``Guide`` and writes the guidance of the Q(x) its GEMM takes
into the engine's ``GuideSink`` with one launch (fp4rl.kernels.trace_record): the same keys, shapes and
bytes as ``trace.compact`` of the same x and Q(x). In the fused decode step a producer kernel (RMSNorm,
SiLU * up) quantizes a W4A4 site's x; while guiding it also writes x (the guidance's amax is x's), and the
site records from both.

Routed experts: the gate/up input is quantized once per token (per-row quantization does not depend on the
other rows, so the sorted rows' Q(x) is a gather of it) and recorded per token; the down input is each
(token, slot) pair's own, recorded in pair order through ``pairs`` (the expert-sorted row of each pair).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from fp4rl import trace

# FP4RL_TRACE_SIDE_STREAM=1: the record kernels run on a side stream (forked after each guided input's
# quantizer, joined before the step's guidance is packed), off the GEMMs' chain of dependent launches.
# Measured on an H200 (twenty-fifth session, bench/RESULTS.md): Qwen3-8B shape, guided step 0.92x vs 0.89x of
# the unguided one at batch 1, 0.89x vs 0.91x at batch 8: no consistent gain, so off by default.
SIDE_STREAM = os.environ.get("FP4RL_TRACE_SIDE_STREAM", "0") == "1"


class GuideSink:
    """The guidance written during one engine forward: input key -> Guidance (device tensors)."""

    def __init__(self):
        self.got: dict[str, trace.Guidance] = {}
        self._side = None  # SIDE_STREAM: the CUDA stream the record kernels run on
        self._held: list = []  # their inputs, kept alive (not reused by the allocator) until the join

    def write(self, key: str, x: torch.Tensor, xq, src: torch.Tensor | None = None,
              lead: tuple | None = None) -> None:
        """Rows of x [R, K] quantized to xq = (data, block_scale, global_scale); src: output row p is x's
        row src[p]; lead: the output rows' shape (default [P])."""
        if key in self.got:  # unfused q/k/v quantize one x three times: the first is kept (trace.Recording)
            return
        from fp4rl.kernels import trace_record

        if SIDE_STREAM and x.is_cuda:
            main = torch.cuda.current_stream(x.device)
            if self._side is None:
                self._side = torch.cuda.Stream(x.device)
            self._side.wait_stream(main)
            self._held.append((x, xq, src))
            with torch.cuda.stream(self._side):
                bits, scales, amax = trace_record.record(x, xq[0], xq[1], src)
        else:
            bits, scales, amax = trace_record.record(x, xq[0], xq[1], src)
        if lead is not None:
            bits, scales, amax = bits.view(*lead, -1), scales.view(*lead, -1), amax.view(lead)
        self.got[key] = trace.Guidance(bits, scales, amax)

    def take(self) -> dict[str, trace.Guidance]:
        if self._held:  # the side stream's record kernels: joined before anyone reads their outputs
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)
            self._held = []
        got, self.got = self.got, {}
        return got


@dataclasses.dataclass
class Guide:
    """What a guided dense site (KernelPackedLinear / KernelFusedGroup) writes: its input key."""

    sink: GuideSink
    key: str

    def quantized(self, x2: torch.Tensor | None, xq, input_kwargs: dict):
        """Q(x2) (made here unless xq is given) after recording its guidance."""
        from fp4rl.kernels import gemm

        if x2 is None:
            raise RuntimeError(f"TRACE on the kernel engine: {self.key} got a Q(x) without x (a fused "
                               "producer's that did not write x; a guided step must: see _step_fused)")
        if xq is None:
            xq = gemm.quantize_activations(x2, scale_rule=input_kwargs["scale_rule"], err=input_kwargs["err"])
        self.sink.write(self.key, x2, xq)
        return xq


@dataclasses.dataclass
class ExpertGuide:
    """What a guided routed-experts plan (gpu_experts._PackedExperts) writes: its gate/up and down keys
    (None: that projection is not guided)."""

    sink: GuideSink
    gate_up: str | None
    down: str | None


def attach(model: torch.nn.Module, deep_fraction: float) -> GuideSink | None:
    """Give the guided sites of the engine's `model` a Guide into one new sink (deep_fraction 0: take every
    Guide away); the sink, or None."""
    for m in model.modules():
        for obj in (m, getattr(m, "group", None), getattr(m, "plan", None)):
            if obj is not None and getattr(obj, "trace_guide", None) is not None:
                obj.trace_guide = None
    if not deep_fraction:
        return None
    try:
        return _attach(model, deep_fraction)
    except Exception:
        attach(model, 0)  # nothing half-attached
        raise


def _attach(model: torch.nn.Module, deep_fraction: float) -> GuideSink:
    from fp4rl.gpu_experts import KernelMoeBlock
    from fp4rl.gpu_linear import KernelFusedGroup, KernelPackedLinear

    sink = GuideSink()
    mods = trace.guided_modules(model, deep_fraction)
    by_id = {id(m): n for n, m in mods.items()}
    for name, m in mods.items():
        if trace.expert_input(name) is None:  # a fused group's members share their group's Guide
            target = getattr(m, "group", None) or m
            if not isinstance(target, (KernelPackedLinear, KernelFusedGroup)):
                raise ValueError(f"TRACE on the kernel engine: {name} does not run on the GPU kernels (a "
                                 "shape they do not take), so its guidance cannot be recorded there; sample "
                                 "with Sampler(kernels=False), or turn precision.trace off")
            target.trace_guide = Guide(sink, trace.input_key(name))
    covered: set[str] = set()
    for m in model.modules():
        if isinstance(m, KernelMoeBlock) and hasattr(m.plan, "gates"):  # packed experts (BF16: none)
            keys = {}
            for proj, members in (("gate_up", m.plan.gates), ("down", m.plan.downs)):
                names = [by_id[id(e)] for e in members if id(e) in by_id]
                keys[proj] = trace.expert_input(names[0])[0] if names else None
            if keys["gate_up"] or keys["down"]:
                m.plan.trace_guide = ExpertGuide(sink, **keys)
                covered.update(k for k in keys.values() if k)
    missing = {trace.expert_input(n)[0] for n in mods if trace.expert_input(n)} - covered
    if missing:
        raise ValueError(f"TRACE on the kernel engine: the routed experts of {sorted(missing)[0]} do not run "
                         "as one packed stack (experts quantized with different settings), so their guidance "
                         "cannot be recorded; give a layer's experts one precision rule, or sample with "
                         "Sampler(kernels=False)")
    return sink


_FIELDS = ("amax", "bits", "block_scale")  # amax (float32) first: every view of the flat bytes stays aligned


def pack(got: dict[str, trace.Guidance]) -> tuple[torch.Tensor, list] | None:
    """Every tensor of one forward's guidance in one flat uint8 tensor (one copy to the host instead of three
    per key), and its layout [(key, field, dtype, shape, byte offset)]; None for no guidance. The float32
    amax come first, so each field's offset is a multiple of its element size."""
    if not got:
        return None
    parts, layout, off = [], [], 0
    for f in _FIELDS:
        for key, g in got.items():
            t = getattr(g, f).contiguous()
            b = t.view(torch.uint8).reshape(-1)
            parts.append(b)
            layout.append((key, f, t.dtype, tuple(t.shape), off))
            off += b.numel()
    return torch.cat(parts), layout


def unpack(flat: torch.Tensor, layout: list, rows: int | None = None) -> dict[str, trace.Guidance]:
    """pack's guidance as views of `flat` (its first `rows` rows)."""
    out: dict[str, dict] = {}
    for key, f, dtype, shape, off in layout:
        n = math.prod(shape) * dtype.itemsize
        t = flat[off:off + n].view(dtype).view(shape)
        out.setdefault(key, {})[f] = t if rows is None else t[:rows]
    return {k: trace.Guidance(**d) for k, d in out.items()}


class EngineRecording:
    """``trace.Recording``'s interface over the engine: ``take`` hands over the last forward's guidance
    (prefill: every row; a decode step: its live rows) as host tensors, ``flush`` makes them final.

    From a GPU each forward's guidance is one packed tensor (``pack``; a decode step's is packed inside its
    CUDA graph) copied without blocking into one of a few reused pinned buffers, then by the host into the
    tensors ``take`` returned, once the copy is done (at the latest in ``flush``, before they are read):
    no pinned allocation per step, one device-to-host copy per step."""

    RING = 4  # pinned buffers in flight

    def __init__(self, engine):
        self.engine = engine
        self.free: list[torch.Tensor] = []  # pinned buffers not in use
        self.pending: list[tuple] = []  # (event, pinned buffer, destination), oldest first

    def take(self) -> dict[str, trace.Guidance]:
        got = self.engine.take_guidance()
        if got is None:
            return {}
        flat, layout, rows = got
        dest = torch.empty(flat.numel(), dtype=torch.uint8)
        if flat.device.type != "cuda":
            dest.copy_(flat)
        else:
            buf = self._buffer(flat.numel())
            buf[:flat.numel()].copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flat.device))
            self.pending.append((event, buf, dest))
        return unpack(dest, layout, rows)

    def _buffer(self, n: int) -> torch.Tensor:
        while self.pending and self.pending[0][0].query():  # copies already done: their buffers come back
            self._finish()
        if not self.free and len(self.pending) >= self.RING:
            self._finish()  # wait for the oldest
        fits = [b for b in self.free if b.numel() >= n]
        if fits:
            self.free.remove(fits[0])
            return fits[0]
        if self.free:  # too small: replaced by a larger one
            self.free.pop(0)
        return torch.empty(max(n, 1 << 16), dtype=torch.uint8, pin_memory=True)

    def _finish(self) -> None:
        event, buf, dest = self.pending.pop(0)
        event.synchronize()
        dest.copy_(buf[:dest.numel()])
        self.free.append(buf)

    def flush(self) -> None:
        """Wait for every copy in flight: the tensors ``take`` returned hold their guidance from here on."""
        while self.pending:
            self._finish()

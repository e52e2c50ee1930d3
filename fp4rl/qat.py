"""NVFP4 quantization-aware linears: forward in 4-bit, backward on the operands it used.

`convert(model, contract)` swaps every nn.Linear that the PrecisionContract marks "w4a16" or
"w4a4" for an NVFP4Linear holding the *same* weight and bias Parameters, so the optimizer,
state_dict and checkpoint keep their Hugging Face names (`...up_proj.weight`) and the model
code never changes (experts are plain nn.Linear and convert the same way).

Forward. With Q the NVFP4 quantizer of fp4rl.nvfp4 and DQ its dequantizer (decode order
(e2m1 * block_scale) * global_scale):

    W4A16:  y = x @ DQ(Q(W)).T + b
    W4A4:   y = DQ(Q(x)) @ DQ(Q(W)).T + b

Q(W) has one FP32 global scale per tensor and is cached per weight version: it is computed
again only when the weight changes (the optimizer's in-place step bumps `weight._version`).
Two kinds of update leave the version as it was: torch's fused optimizers (`AdamW(fused=True)`)
and writes through `.data`. After those call `invalidate(model)`, or once
`track(optimizer, model)` (invalidates after every step); fp4rl's Trainer uses the foreach
AdamW, which bumps it.
Linears that inference servers fuse into one GEMM with one global scale (q/k/v_proj, and
gate/up_proj, of one block) share one: the amax of the group (contract.fuse_global_scales), so
the bytes exported to a server are the bytes trained with.
Q(x) has one FP32 global scale per token (`scale_scope="row"`), computed online from that
token alone: no calibration, no dependence on the batch or on future tokens. Both follow the
contract's 4/6 settings. `NVFP4Linear.quantize_input` is the one place where activations are
quantized; rollout-guided rounding (TRACE) overrides it.

Backward. Q has zero gradient almost everywhere, so QAT passes gradients straight through it
to the high-precision master weight. Which operands the backward GEMMs use is the contract's
`backward` mode (mission point 3):

    "dequantized":     grad_x = grad_y @ DQ(Q(W))      grad_W = grad_y.T @ DQ(Q(x))
    "high_precision":  grad_x = grad_y @ W             grad_W = grad_y.T @ x

"dequantized" is the gradient of the function the forward actually computed (the operands
are bit-identical to the forward's); in the NVFP4 RL recipe it removed most gradient-norm
spikes. It also sets the memory cost: autograd keeps the *packed* operands for backward
(uint8 codes, two per byte + one E4M3 scale per 16 values + FP32 global scales: 0.5625
byte/element) and dequantizes them in backward, where a naive fake-quant QAT
(`x + (DQ(Q(x)) - x).detach()` then F.linear) keeps 2-byte BF16 copies of DQ(Q(x)) and DQ(Q(W)):
~3.5x fewer bytes per quantized operand. "high_precision" keeps x itself (and W, a Parameter
that is alive anyway). In W4A16 x is not quantized: both modes keep x.

Dtypes. The GEMMs run in the input's dtype, or in the autocast dtype when autocast is on
(BF16 on CPU and GPU); gradients come back in the dtypes of x, W and b, as with F.linear under
autocast. The quantizer always reads the tensors as they are (the FP32 master weight, the
activation as it arrives).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from fp4rl.nvfp4 import NonFiniteError, NVFP4Tensor, dequantize, quantize
from fp4rl.precision import PrecisionContract

_PACKED_FIELDS = ("data", "block_scale", "global_scale")
_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # one GEMM in servers


def _split(q: NVFP4Tensor) -> tuple[list[torch.Tensor], tuple]:
    """NVFP4Tensor -> (its packed tensors, what rebuilds it around them): tensors go through
    save_for_backward, where saved-tensor hooks see them; the rest is plain metadata."""
    meta = {f.name: getattr(q, f.name) for f in dataclasses.fields(q) if f.name not in _PACKED_FIELDS}
    return [getattr(q, f) for f in _PACKED_FIELDS], (type(q), meta)


def _join(tensors, how) -> NVFP4Tensor:
    cls, meta = how
    return cls(**dict(zip(_PACKED_FIELDS, tensors)), **meta)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _NVFP4LinearFunction(torch.autograd.Function):
    """y = xq @ DQ(qw).T + b where xq = DQ(qx) (W4A4) or x (W4A16); see the module docstring.

    qw and qx are NVFP4Tensors quantized outside (cached weight, `quantize_input`); only their
    packed tensors are saved for the dequantized backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, qw, qx, backward, dtype):
        # x: [..., K], weight: [N, K], qw: NVFP4 of weight, qx: NVFP4 of x.reshape(-1, K) or None
        with torch.autocast(x.device.type, enabled=False):
            w_dq = dequantize(qw, dtype)  # [N, K]
            x_dq = dequantize(qx, dtype).reshape(x.shape) if qx is not None else x.to(dtype)  # [..., K]
            y = F.linear(x_dq, w_dq, None if bias is None else bias.to(dtype))  # [..., N]
        ctx.backward, ctx.dtype, ctx.x_shape, ctx.has_bias = backward, dtype, x.shape, bias is not None
        ctx.grad_dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        if backward == "high_precision":
            ctx.save_for_backward(x, weight)
        else:
            saved, ctx.qw = _split(qw)
            if qx is not None:
                saved_x, ctx.qx = _split(qx)
            else:
                saved_x, ctx.qx = [x], None
            ctx.save_for_backward(*saved, *saved_x)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        dtype, n = ctx.dtype, len(_PACKED_FIELDS)
        with torch.autocast(grad_y.device.type, enabled=False):
            if ctx.backward == "high_precision":
                x, weight = ctx.saved_tensors
                w_op, x_op = weight.to(dtype), x.to(dtype).reshape(-1, x.shape[-1])  # [N, K], [M, K]
            else:
                saved = ctx.saved_tensors
                w_op = dequantize(_join(saved[:n], ctx.qw), dtype)  # [N, K]
                x_op = dequantize(_join(saved[n:], ctx.qx), dtype) if ctx.qx else saved[n].to(dtype)
                x_op = x_op.reshape(-1, w_op.shape[1])  # [M, K]
            g = grad_y.to(dtype).reshape(-1, grad_y.shape[-1])  # [M, N]
            x_dtype, w_dtype, b_dtype = ctx.grad_dtypes
            grad_x = (g @ w_op).reshape(ctx.x_shape).to(x_dtype) if ctx.needs_input_grad[0] else None
            grad_w = (g.t() @ x_op).to(w_dtype) if ctx.needs_input_grad[1] else None
            grad_b = g.sum(0).to(b_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None


class NVFP4Linear(nn.Module):
    """A linear whose forward runs in NVFP4 (mode "w4a16" or "w4a4") over a high-precision master
    weight. `weight` and `bias` are the Parameters of the nn.Linear it replaces."""

    is_linear = True  # precision.is_linear: a converted model still resolves and summarizes

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, mode: str,
                 contract: PrecisionContract | None = None):
        super().__init__()
        contract = contract or PrecisionContract()
        if mode not in ("w4a16", "w4a4"):
            raise ValueError(f"NVFP4Linear mode={mode!r}: use 'w4a16' or 'w4a4'")
        self.weight, self.bias, self.mode = weight, bias, mode
        self.out_features, self.in_features = weight.shape
        self.backward = contract.backward
        self.weight_kwargs = contract.weight_quantize_kwargs()
        self.input_kwargs = contract.input_quantize_kwargs()
        self._qweight: NVFP4Tensor | None = None
        self._qweight_key = None
        self.scale_group = [self]  # linears sharing one weight global scale (a plain list: set by convert)
        self.module_name = ""  # its name in the model (set by convert): errors name it

    def _nonfinite(self, what: str, exc: NonFiniteError | str) -> ValueError:
        where = f" {self.module_name}" if self.module_name else ""
        return ValueError(
            f"NVFP4Linear{where}: its {what} holds NaN or Inf, so it cannot be quantized ({exc}). The model "
            "diverged or was given a damaged checkpoint: lower trainer.lr or set trainer.grad_clip > 0, and "
            "resume from a checkpoint before the step that produced them (fp4rl train --resume)")

    def quantized_weight(self, device=None) -> NVFP4Tensor:
        """Q(W), cached until the weight changes (in place, or a new tensor/storage). Built outside inference
        mode even under torch.inference_mode(): a cache of inference tensors made by an evaluation would be
        saved for backward by the next training step, which autograd refuses.

        device: where Q(W) is wanted. If the master weight lives elsewhere (a trainer held in host memory, a
        sampler on a GPU) and no cached Q(W) is current, the group's weights are copied there one at a time
        and quantized there, nothing cached: the same bytes as the cache would hold (the quantizer is
        bit-exact across devices), without the master weights on that device. A current cache is returned
        where it is (the caller copies it)."""
        weights = [m.weight for m in self.scale_group]
        key = [(w._version, w.data_ptr(), w.dtype, w.device, tuple(w.shape)) for w in weights]
        current = self._qweight is not None and self._qweight_key == key
        if device is not None and not current:
            device = torch.empty(0, device=device).device  # "cuda" -> "cuda:<current>"
            if device != self.weight.device:
                self._qweight = self._qweight_key = None  # stale, and it may hold memory on another device
                return self._quantize_group(weights, device)
        if not current or self._qweight.data.is_inference():
            self._qweight = self._quantize_group(weights, None)
            self._qweight_key = key
        return self._qweight

    def _quantize_group(self, weights: list[torch.Tensor], device) -> NVFP4Tensor:
        """Q(W) of this linear with its scale group's global scale; each weight copied to `device` first
        (None: where it is)."""
        on = (lambda w: w.detach().to(device)) if device is not None else (lambda w: w.detach())
        dev_type = (device if device is not None else self.weight.device).type
        with torch.inference_mode(False), torch.no_grad(), torch.autocast(dev_type, enabled=False):
            amax = None
            if len(weights) > 1:  # one global scale for the group: its amax
                amax = torch.stack([on(w).abs().amax().float() for w in weights]).amax()
                if not bool(torch.isfinite(amax)):
                    bad = [m.module_name or "?" for m in self.scale_group
                           if not bool(torch.isfinite(m.weight).all())]
                    raise self._nonfinite(f"fused group's weights (one global scale; non-finite: "
                                          f"{', '.join(bad)})", f"their amax is {amax.item()}")
            try:
                return quantize(on(self.weight), amax=amax, **self.weight_kwargs)
            except NonFiniteError as exc:
                raise self._nonfinite("weight", exc) from None

    def quantize_input(self, x: torch.Tensor) -> NVFP4Tensor:
        """Q(x) of activations x: [M, K], one global scale per token (row). Override this for
        rollout-guided rounding; the result must be an NVFP4Tensor of x's shape."""
        return quantize(x, **self.input_kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qw = self.quantized_weight()
        qx = None
        if self.mode == "w4a4":
            with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
                try:
                    qx = self.quantize_input(x.detach().reshape(-1, x.shape[-1]))  # [M, K]
                except NonFiniteError as exc:
                    raise self._nonfinite("input activation", exc) from None
        return _NVFP4LinearFunction.apply(x, self.weight, self.bias, qw, qx, self.backward,
                                          _compute_dtype(x))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, mode={self.mode}, backward={self.backward}")


def convert(model: nn.Module, contract: PrecisionContract) -> nn.Module:
    """Swap, in place, every linear of `model` to the precision `contract.resolve(model)` gives it:
    nn.Linear -> NVFP4Linear for "w4a16"/"w4a4", and back to nn.Linear for "bf16" (so converting
    again with another contract works). Parameters are shared, never copied. Returns `model`."""
    resolved = contract.resolve(model)
    tile_rows = 16 if contract.weight_tile == (16, 16) else 1
    swaps = []  # all checks first: a refused conversion leaves the model as it was
    for name, precision in resolved.items():
        old = model.get_submodule(name)
        if precision == "bf16":
            if not isinstance(old, NVFP4Linear):
                continue
            new = nn.Linear(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
        else:
            out_features, in_features = old.weight.shape
            if in_features % 16 or out_features % tile_rows:
                tiles = "16x16" if tile_rows == 16 else "1x16"
                raise ValueError(f"convert: {name} ({out_features}x{in_features}) cannot be NVFP4 with "
                                 f"{tiles} tiles: in_features must be a multiple of 16"
                                 + (" and out_features too" if tile_rows == 16 else "")
                                 + f"; keep it BF16 with a rule ('{name}', 'bf16')")
            new = NVFP4Linear(old.weight, old.bias, precision, contract)
            new.module_name = name
        new.weight, new.bias = old.weight, old.bias
        swaps.append((name, new))
    for name, new in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    if contract.fuse_global_scales:
        for parent in model.modules():
            for names in _FUSED_GROUPS:
                group = [getattr(parent, n, None) for n in names]
                group = [m for m in group if isinstance(m, NVFP4Linear)]
                for m in group:
                    m.scale_group = group
    return model


def invalidate(model: nn.Module) -> int:
    """Drop every NVFP4Linear's cached Q(W) (after a weight update that kept the version counter: a
    fused optimizer step, a write through .data); the next forward quantizes again. -> linears cleared."""
    linears = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    for m in linears:
        m._qweight = m._qweight_key = None
    return len(linears)


def track(optimizer: torch.optim.Optimizer, model: nn.Module):
    """Invalidate `model`'s Q(W) caches after every `optimizer.step()` (for optimizers that update in
    place without the version counter, e.g. AdamW(fused=True)). -> the hook handle (.remove() undoes it)."""
    return optimizer.register_step_post_hook(lambda *_: invalidate(model))


def packed_state(model: nn.Module) -> dict[str, NVFP4Tensor]:
    """{parameter name (`....weight`): NVFP4Tensor} of every NVFP4Linear's weight, exactly the
    bytes its forward computes with (weight sync and export ship these)."""
    return {f"{name}.weight": m.quantized_weight() for name, m in model.named_modules()
            if isinstance(m, NVFP4Linear)}

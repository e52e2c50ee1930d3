"""The fused decode step's plan (fp4rl.gpu_decode): per decoder layer, which linears take a fused producer's
output (`fused_plans`), each as a `_Site` the step calls on a [M, K] input: the kernel-backed linear or fused
group's run (W4A16 / W4A4, with the Q(x) its producer made), a dense BF16 group's F.linear, or a module. A
layer or half the plan does not cover runs its modules on the norm's bf16 output."""

from __future__ import annotations

from types import SimpleNamespace

import torch.nn.functional as F
from torch import nn

from fp4rl.gpu_linear import KERNEL_DTYPE, KernelFusedGroup, KernelPackedLinear
from fp4rl.model import MLP, CausalLM
from fp4rl.packed import FusedGroup, PackedNVFP4Linear


class _Site:
    """A linear or fused group as the fused step calls it: run(x2 [M, K] bf16, xq=None) -> y [M, N]; quant:
    the activation quantizer's settings when it takes a Q(x) made by the producer (W4A4), else None;
    norm_run(x, h, norm, moe) -> (x', run(norm(x'))) in one launch, x' = x + h or x + the MoE combine of moe
    = (d, pos, w), or None (kernel linears: DENSE_NORM); silu_run(x2) -> fused.silu_mul(run(x2))[0], the
    dense MLP's gate | up and its SiLU * up in one launch where the kernel takes it, or None (only W4A16
    kernel gate | up groups have it); rn: the kernel linear or group whose rn_takes / rn_out / rn_in split the
    residual add + RMSNorm over it and its neighbour (gpu_decode.RESNORM, fp4rl.kernels.resnorm), or None."""

    def __init__(self, run, quant: dict | None = None, norm_run=None, silu_run=None, rn=None):
        self.run, self.quant, self.norm_run, self.silu_run = run, quant, norm_run, silu_run
        self.rn = rn


def _records(site: _Site | None) -> bool:
    """Whether the site's module records TRACE guidance now (a gpu_trace.Guide on it: it needs x, not only
    the Q(x) its producer makes)."""
    owner = getattr(getattr(site, "run", None), "__self__", None)
    return getattr(owner, "trace_guide", None) is not None


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
            return _Site(group.run, _quant_of(group.members[0]), group.norm_run,
                         group.silu_run if group.takes_silu_out else None, group)
        if not group.packed and group._weight is not None and group._weight.dtype == KERNEL_DTYPE:
            return _Site(_dense_group_run(group))
        return None
    m = mods[0]
    if group is not None:
        return None
    if isinstance(m, KernelPackedLinear):
        return _Site(m.run, _quant_of(m), m.norm_run, rn=m)
    return _Site(_module_run(m))


def fused_plans(model: CausalLM) -> list | None:
    """Per decoder layer: the q/k/v site (None: the layer's attention runs its modules) and the o_proj site
    after it, the gate/up and down sites of a dense MLP (None: MoE or unfused), and which norm outputs are
    quantized for their consumer. None when the fused kernels do not cover the model at all (norm weights not
    bf16)."""
    m = model.model
    norms = [m.norm] + [n for layer in m.layers
                        for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(n.weight.dtype != KERNEL_DTYPE for n in norms):
        return None
    plans = []
    for layer in m.layers:
        attn, mlp = layer.self_attn, layer.mlp
        p = SimpleNamespace(qkv=None, o=None, gate_up=None, down=None, in_quant=None, post_quant=None)
        qk_ok = not hasattr(attn, "q_norm") or (
            attn.q_norm.weight.dtype == KERNEL_DTYPE and attn.k_norm.weight.dtype == KERNEL_DTYPE
            and attn.q_norm.eps == attn.k_norm.eps)
        qkv = linear_site([attn.q_proj, attn.k_proj, attn.v_proj])
        if qkv is not None and qk_ok:
            p.qkv, p.in_quant, p.o = qkv, qkv.quant, linear_site([attn.o_proj])
        if not layer.is_moe and isinstance(mlp, MLP):
            gate_up = linear_site([mlp.gate_proj, mlp.up_proj])
            down = linear_site([mlp.down_proj])
            if gate_up is not None and down is not None:
                p.gate_up, p.down, p.post_quant = gate_up, down, gate_up.quant
        plans.append(p)
    return plans

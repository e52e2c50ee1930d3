"""TRACE: rollout-guided rounding of the trainer's activations, and its compact guidance cache.

The trainer's activations differ slightly from the sampler's (other kernels, batch shapes,
precision of the non-quantized parts); where x sits near an E2M1 rounding boundary, a tiny
difference becomes a whole code step, and the trainer computes with other 4-bit inputs than the
sampler did. TRACE has the sampler record how it quantized each activation row of the guided
linears, and the trainer's W4A4 forward reproduce it:

- Guidance per row (``Guidance``): the row's amax (float32: with the quantizer's scale rule it
  gives the global scales exactly), the E4M3 block scales the sampler chose (4/6 included), and
  one bit per element, the lowest bit of the code's magnitude index. Adjacent E2M1 values differ
  in that bit, so it picks between the two neighbours of any value: K/8 + K/16 + 4 bytes per row
  of K (the compact cache; ~1/6 of the sampler's own 4-bit codes + scales + BF16 x it replaces).
- Guided rounding (``guided_quantize``): the trainer's x is scaled with the *rollout-side* scales,
  z = x * enc (the quantizer's own enc), |z| clipped to 6; of the two E2M1 neighbours of |z| it takes
  the one whose index has the recorded bit; the sign is z's, as the quantizer sets it. On a grid point
  whose bit differs it keeps the point: both codes with the bit are a step away, so a guess could land
  two steps from the sampler's code where round-to-nearest is one (the method's promise: never worse
  than round-to-nearest); at 6 (every clipped |z|) it takes 4, the only neighbour with the bit. The
  codes and scales are then the sampler's wherever the sampler's code is one of the two E2M1 values
  around the trainer's z off the grid (every one-step mismatch);
  where x is the sampler's x they are the sampler's bytes exactly (tested). Gradients pass straight
  through as for any Q(x) (qat.py).

Who is guided: the W4A4 linears of the deepest `deep_fraction` of the decoder layers that can
hold them (layers 0 .. the deepest one with a W4A4 linear: the BF16 last layers are not counted;
``guided_layers``). Routed experts (the recipe's W4A4 linears) are guided per token and slot: an expert
runs on a routing-dependent subset of the tokens, so SparseMoeBlock.run_experts says which (token, slot)
pairs its rows are (moe.EXPERT_ROWS). Their gate/up input is the token's row whichever expert reads it, so
its guidance is per token ([..., K/8] like a dense input, key "<layer>.mlp.experts.gate_proj"); the down
projection's input, SiLU(gate) * up, is the slot's expert's own, so its guidance is per token and slot
([..., top_k, F/8], key "<layer>.mlp.experts.down_proj"). The trainer replays the sampler's routing
(batch.routing), so each slot's guidance meets the expert that produced it. The paper keeps guidance for
the deep half only (it finds the mismatches there); here
every W4A4 layer is the default (precision.trace_deep_fraction = 1): a flip left in a shallow layer
moves every later layer's activations, which is where the deep mismatches come from (SmolLM2-135M,
W4A4: |logprob diff| 0.39 unguided, 0.30 with the deep half guided, 0.009 with all layers).

Counters (``TraceStats``): elements guided (an input q/k/v or gate/up share counts once; a routed
token's gate/up input counts once per expert it goes to, as each expert quantizes it), those whose
round-to-nearest code (on the rollout scales) has another bit than recorded (``trace/code_disagree_rtn``:
a lower bound of the codes that guidance changes), those whose guided code still has another bit than
recorded (``trace/code_disagree_guided``: only exact grid hits, above, where the trainer keeps its point
rather than guess a neighbour; the bit is all the trainer knows of the sampler's code, so this is the part of
the disagreement guidance cannot remove), and the cache's bytes per token (``trace/cache_bytes_per_token``).

Hooks: ``recording(model)`` captures guidance from every guided linear's activation quantizer while
the sampler's model runs (``Recording.take`` hands it over per forward); ``guiding(model, guidance)``
makes the trainer's guided linears round with it for one forward. Both hook the one place where the
torch paths quantize activations, ``quantize_input`` of qat.NVFP4Linear / packed.PackedNVFP4Linear; the
GPU kernel sampler quantizes in its own modules and records there (fp4rl.gpu_trace, same keys and bytes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Iterator

import torch

from fp4rl.moe import EXPERT_ROWS, ExpertRows
from fp4rl.nvfp4 import NVFP4Tensor, quantize
from fp4rl.nvfp4.format import E2M1_VALUES, pack_fp4, round_to_e2m1, unpack_fp4
from fp4rl.nvfp4.reference import block_encode_scale, global_scales_from_amax

_GRID = torch.tensor(E2M1_VALUES, dtype=torch.float32)  # magnitudes of indices 0..7
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclasses.dataclass
class Guidance:
    """Compact guidance of activation rows of width K (leading dims [...] any): bits uint8 [..., K/8]
    (bit j % 8 of byte j // 8 is element j's magnitude-index parity), block_scale float8_e4m3fn
    [..., K/16], amax float32 [...]."""

    bits: torch.Tensor
    block_scale: torch.Tensor
    amax: torch.Tensor

    @property
    def width(self) -> int:
        return self.bits.shape[-1] * 8

    def bytes_per_row(self) -> int:
        return self.bits.shape[-1] + self.block_scale.shape[-1] + 4

    def bytes_per_token(self, token_dims: int) -> int:
        """Bytes per token when the first `token_dims` leading dims are tokens (a routed experts' down
        projection keeps top_k rows per token)."""
        return self.bytes_per_row() * math.prod(self.amax.shape[token_dims:])

    def flat(self) -> Guidance:
        """Rows flattened: [N, ...]."""
        return Guidance(self.bits.reshape(-1, self.bits.shape[-1]),
                        self.block_scale.reshape(-1, self.block_scale.shape[-1]), self.amax.reshape(-1))

    def index(self, *idx) -> Guidance:
        return Guidance(self.bits[idx], self.block_scale[idx], self.amax[idx])

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {"bits": self.bits, "block_scale": self.block_scale, "amax": self.amax}

    @staticmethod
    def cat(parts: list[Guidance]) -> Guidance:
        """Rows of `parts` one after the other (first dimension)."""
        return Guidance(*(torch.cat([getattr(p, f) for p in parts]) for f in ("bits", "block_scale", "amax")))

    @staticmethod
    def from_dict(d: dict) -> Guidance:
        return Guidance(d["bits"], d["block_scale"], d["amax"])

    @staticmethod
    def empty(lead: tuple, width: int) -> Guidance:
        return Guidance(torch.zeros(*lead, width // 8, dtype=torch.uint8),
                        torch.zeros(*lead, width // 16, dtype=torch.float8_e4m3fn),
                        torch.zeros(*lead, dtype=torch.float32))


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """0/1 uint8 [M, K] -> [M, K/8], element j at bit j % 8 of byte j // 8."""
    weights = (1 << torch.arange(8, dtype=torch.uint8, device=bits.device))
    return (bits.view(bits.shape[0], -1, 8) * weights).sum(-1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def compact(x: torch.Tensor, q: NVFP4Tensor) -> Guidance:
    """The guidance of activations x [M, K] that the sampler quantized to q (per-row scales)."""
    if x.ndim != 2 or q.data.shape != (x.shape[0], x.shape[1] // 2):
        raise ValueError(f"compact: x must be [M, K] with q its per-row NVFP4 tensor; got x "
                         f"{tuple(x.shape)}, q.data {tuple(q.data.shape)}")
    if x.shape[1] % 16:
        raise ValueError(f"compact: K = {x.shape[1]} is not a multiple of 16 (NVFP4 blocks)")
    codes = unpack_fp4(q.data)
    return Guidance(_pack_bits(codes & 1).cpu(), q.block_scale.cpu(), x.detach().float().abs().amax(-1).cpu())


@dataclasses.dataclass
class TraceStats:
    """Counters of guided rounding (summed over calls; ``metrics`` gives the logged ratios)."""

    elements: int = 0
    disagree_rtn: int = 0
    disagree_guided: int = 0
    cache_bytes: int = 0
    tokens: int = 0

    def metrics(self) -> dict[str, float]:
        if not self.elements:
            return {}
        return {"trace/code_disagree_rtn": self.disagree_rtn / self.elements,
                "trace/code_disagree_guided": self.disagree_guided / self.elements,
                "trace/cache_bytes_per_token": self.cache_bytes / max(1, self.tokens)}


def guided_quantize(x: torch.Tensor, guide: Guidance, valid: torch.Tensor | None = None, *,
                    scale_rule: str = "6", stats: TraceStats | None = None, name: str = "",
                    **rtn_kwargs) -> NVFP4Tensor:
    """Q(x) of activations x [M, K] rounded towards the sampler's codes (module docstring). Rows with
    valid[i] False (valid [M] bool; no guidance: padding, or tokens the sampler never saw) are quantized
    to nearest with rtn_kwargs (the contract's input settings); scale_rule must be the sampler's. `name`
    (the linear's) only goes into error messages."""
    where = f" of {name}" if name else ""
    if x.ndim != 2 or guide.bits.ndim != 2 or guide.bits.shape[0] != x.shape[0] or guide.width != x.shape[1]:
        raise ValueError(f"guided_quantize{where}: x {tuple(x.shape)} and guidance bits "
                         f"{tuple(guide.bits.shape)} do not match (one guidance row per activation row, K/8 "
                         "bytes each)")
    M, K = x.shape
    if valid is not None and tuple(valid.shape) != (M,):
        raise ValueError(f"guided_quantize{where}: valid has shape {tuple(valid.shape)}, expected ({M},): "
                         "one flag per activation row (True where the row has guidance)")
    valid = torch.ones(M, dtype=torch.bool) if valid is None else valid.to(torch.bool).cpu()
    if not bool(torch.isfinite(x).all()):
        bad = ~torch.isfinite(x.detach())
        raise ValueError(
            f"TRACE guided rounding{where}: the trainer's activations hold {int(bad.sum())} NaN/Inf of "
            f"{x.numel()} (first rows: {bad.any(1).nonzero()[:5, 0].tolist()}): the model produced "
            "non-finite activations. Check the weights (a diverged update: lower the learning rate or clip "
            "gradients, and resume from a checkpoint before the step that produced them)")
    if not bool(valid.any()):
        return quantize(x, scale_rule=scale_rule, scale_scope="row", **rtn_kwargs)
    xf = x.detach().float()
    dev = x.device
    data = torch.empty(M, K // 2, dtype=torch.uint8, device=dev)
    block_scale = torch.empty(M, K // 16, dtype=torch.float8_e4m3fn, device=dev)
    global_scale = torch.empty(M, 1, dtype=torch.float32, device=dev)
    if not bool(valid.all()):  # rows without guidance: round to nearest on their own scales
        plain = (~valid).nonzero()[:, 0].to(dev)
        rtn = quantize(x[plain], scale_rule=scale_rule, scale_scope="row", **rtn_kwargs)
        data[plain], block_scale[plain], global_scale[plain] = rtn.data, rtn.block_scale, rtn.global_scale
    rows = valid.nonzero()[:, 0].to(dev)
    bs = guide.block_scale[valid].to(dev)
    gs = global_scales_from_amax(guide.amax[valid].to(dev).reshape(-1, 1), scale_rule)
    enc = block_encode_scale(bs.unsqueeze(-1), gs.decode_for_encoding.unsqueeze(-1))  # [m, K/16, 1]
    z = (xf[rows].view(len(rows), K // 16, 16) * enc).view(len(rows), K)
    mag = z.abs().clamp(max=6.0)
    grid = _GRID.to(dev)
    lo = (torch.bucketize(mag, grid, right=True) - 1).clamp(0, 7)  # largest index with grid <= |z|
    hi = (lo + 1).clamp(max=7)
    bit = _unpack_bits(guide.bits[valid].to(dev)).to(torch.int64)
    on_grid = grid[lo] == mag
    # on a grid point whose bit differs, both codes with the bit are one step away (below 6; and at 0 they are
    # +-0.5): either guess is 0 or 2 steps from the sampler's code where round-to-nearest is 1, so keep the
    # point; at 6 (and every clipped |z|) the only code with the bit is the one below
    stay = torch.where(lo == 7, lo - 1, lo)
    pick = torch.where((lo & 1) == bit, lo, torch.where(on_grid, stay, hi))
    codes = pick.to(torch.uint8) | ((z < 0).to(torch.uint8) << 3)  # the sign as round_to_e2m1 sets it
    if stats is not None:
        nearest = round_to_e2m1(z).to(torch.int64)  # round-to-nearest on the rollout scales
        stats.elements += rows.numel() * K
        stats.disagree_rtn += int(((nearest & 1) != bit).sum())
        stats.disagree_guided += int(((pick & 1) != bit).sum())
    data[rows], block_scale[rows], global_scale[rows] = pack_fp4(codes), bs, gs.global_scale
    return NVFP4Tensor(data=data, block_scale=block_scale, global_scale=global_scale, shape=x.shape,
                       dtype=x.dtype, tile=16, scale_rule=scale_rule)


def layer_of(name: str) -> int | None:
    m = _LAYER.search(f".{name}.")
    return int(m.group(1)) if m else None


def guided_layers(num_layers: int, deep_fraction: float = 1.0) -> range:
    """The deepest ceil(deep_fraction * L) decoder layers."""
    n = min(num_layers, math.ceil(deep_fraction * num_layers - 1e-9))
    return range(num_layers - n, num_layers)


def guided_modules(model: torch.nn.Module, deep_fraction: float = 1.0) -> dict[str, torch.nn.Module]:
    """The W4A4 linears (trainer NVFP4Linear or sampler PackedNVFP4Linear) of the guided layers, by name,
    routed experts included (``expert_input``)."""
    found = {n: m for n, m in model.named_modules()
             if getattr(m, "mode", None) == "w4a4" and hasattr(m, "quantize_input")
             and layer_of(n) is not None}
    if not found:
        return {}
    _check_experts_alike(model, found)
    layers = guided_layers(1 + max(layer_of(n) for n in found), deep_fraction)
    return {n: m for n, m in found.items() if layer_of(n) in layers}


def _check_experts_alike(model: torch.nn.Module, w4a4: dict) -> None:
    """Routed experts' guidance is per token (and slot) for the whole layer: every expert of a layer must
    quantize a projection's input alike (W4A4 in all or in none), else some rows would have none."""
    every: dict[str, set] = {}
    for n, m in model.named_modules():
        match = _EXPERT.match(n)
        if match and hasattr(m, "quantize_input"):
            every.setdefault(f"{match.group(1)}.*.{match.group(2)}", set()).add(n)
    for proj, names in every.items():
        some = names & set(w4a4)
        if some and some != names:
            raise ValueError(f"TRACE guides the routed experts per token and slot, so every expert of a "
                             f"layer must quantize {proj} alike; {len(some)} of its {len(names)} experts are "
                             f"W4A4 (e.g. {sorted(some)[0]}) and the others not (e.g. "
                             f"{sorted(names - some)[0]}): make precision rules cover all of a layer's "
                             "experts, or turn precision.trace off")


_SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(\w+)$")


def expert_input(name: str) -> tuple[str, bool] | None:
    """For a routed expert's linear (".experts.<i>.<proj>"): (its guidance key, whether that guidance is
    per token and slot: the down projection's); None for any other linear."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    proj = _SHARED_INPUT.get(m.group(2), m.group(2))
    return f"{m.group(1)}.{proj}", proj == "down_proj"


def input_key(name: str) -> str:
    """Linears reading the same input share one guidance: k/v_proj use q_proj's, up_proj gate_proj's
    (the sampler quantizes a fused group's input once); every routed expert of a layer shares one key per
    projection input (``expert_input``)."""
    expert = expert_input(name)
    if expert is not None:
        return expert[0]
    head, _, last = name.rpartition(".")
    return f"{head}.{_SHARED_INPUT[last]}" if last in _SHARED_INPUT else name


def _rows_now(name: str) -> ExpertRows:
    rows = EXPERT_ROWS.get()
    if rows is None:
        raise RuntimeError(f"TRACE: the routed expert linear {name} ran outside SparseMoeBlock.run_experts, "
                           "which says which (token, slot) rows it gets (moe.EXPERT_ROWS); a MoE path that "
                           "overrides run_experts must set it too, or run without TRACE")
    return rows


def _expert_index(rows: ExpertRows, per_slot: bool) -> torch.Tensor:
    """The flat guidance rows of an expert's activation rows: token, or token * top_k + slot."""
    return rows.token * rows.top_k + rows.slot if per_slot else rows.token


class Recording:
    """Guidance captured by ``recording``: per input key, the rows of the calls since the last take
    (a routed experts' key: [tokens] or [tokens, top_k] rows, gathered from every expert's calls)."""

    def __init__(self):
        self._got: dict[str, Guidance] = {}
        self._experts: dict[str, tuple[tuple, list]] = {}  # key -> (lead, [(flat rows, guidance)])

    def add(self, key: str, g: Guidance) -> None:
        self._got.setdefault(key, g)  # unfused q/k/v quantize the same x three times: keep one

    def add_rows(self, key: str, lead: tuple, index: torch.Tensor, g: Guidance) -> None:
        """Rows `index` (into the flattened `lead`) of a routed experts' key."""
        have = self._experts.setdefault(key, (lead, []))
        if have[0] != lead:
            raise RuntimeError(f"TRACE: {key} recorded rows of {have[0]} and of {lead} tokens in one forward")
        have[1].append((index.cpu(), g))

    def take(self) -> dict[str, Guidance]:
        got, self._got = self._got, {}
        for key, (lead, parts) in self._experts.items():
            out = Guidance.empty(lead, parts[0][1].width).flat()
            seen = torch.zeros(out.amax.shape[0], dtype=torch.bool)
            for index, g in parts:  # (the same token's gate/up rows from each of its experts: equal)
                out.bits[index], out.block_scale[index], out.amax[index] = g.bits, g.block_scale, g.amax
                seen[index] = True
            if not bool(seen.all()):
                raise RuntimeError(f"TRACE: {key} has no guidance for {int((~seen).sum())} of its "
                                   f"{seen.numel()} rows (every token's experts should have run)")
            got[key] = Guidance(out.bits.view(*lead, -1), out.block_scale.view(*lead, -1),
                                out.amax.view(lead))
        self._experts = {}
        return got

    def flush(self) -> None:
        """Nothing in flight here (the kernel engine's recording copies from the GPU: gpu_trace)."""


def _patch(mods: dict[str, torch.nn.Module], make) -> None:
    for name, m in mods.items():
        m.quantize_input = make(name, m, type(m).quantize_input.__get__(m))


def _unpatch(mods: dict[str, torch.nn.Module]) -> None:
    for m in mods.values():
        m.__dict__.pop("quantize_input", None)


@contextlib.contextmanager
def recording(model: torch.nn.Module, deep_fraction: float = 1.0) -> Iterator[Recording]:
    """While active, every guided linear of `model` records the guidance of what it quantizes."""
    rec, mods = Recording(), guided_modules(model, deep_fraction)
    done: dict[str, ExpertRows] = {}  # key -> the expert call it last recorded (unfused gate/up: once)

    def make(name, m, orig):
        expert = expert_input(name)

        def quantize_input(x):
            q = orig(x)
            if expert is None:
                rec.add(input_key(name), compact(x, q))
                return q
            rows = _rows_now(name)
            if done.get(expert[0]) is rows:
                return q
            done[expert[0]] = rows
            if expert[1]:  # the down input: every (token, slot) row is this expert's own
                rec.add_rows(expert[0], (rows.tokens, rows.top_k), _expert_index(rows, True), compact(x, q))
            else:  # gate/up: a token's row is the same for each of its experts; keep its slot-0 expert's
                first = (rows.slot == 0).cpu()
                if bool(first.any()):
                    g = compact(x, q).index(first)
                    rec.add_rows(expert[0], (rows.tokens,), rows.token.cpu()[first], g)
            return q
        return quantize_input

    _patch(mods, make)
    try:
        yield rec
    finally:
        _unpatch(mods)
        done.clear()


@contextlib.contextmanager
def guiding(model: torch.nn.Module, guidance: dict[str, Guidance], valid: torch.Tensor,
            stats: TraceStats | None = None, deep_fraction: float = 1.0) -> Iterator[None]:
    """While active, the guided linears of `model` round their activation rows (flattened [N, K])
    with guidance[input_key(name)] ([N] rows; valid [N] marks the rows that have it; a routed experts'
    down key has [N, top_k] rows, and each expert takes its (token, slot) rows, moe.EXPERT_ROWS).

    Linears that read one input (q/k/v, gate/up: ``input_key``) quantize it once: the last input's
    Q(x) is kept and handed to the next linear of the same key given the same tensor (same storage,
    shape, strides, version; it is held, so its memory cannot be reused meanwhile), so `stats` counts
    each guided input once."""
    mods = {n: m for n, m in guided_modules(model, deep_fraction).items() if input_key(n) in guidance}
    valid = valid.reshape(-1).to(torch.bool)
    flats = {k: guidance[k].flat() for k in {input_key(n) for n in mods}}  # once per key, not per expert
    last: dict = {}  # "id": the last quantized input's identity, "x": it (held), "q": its Q(x)
    here: dict = {}  # "rows": the expert call being guided, "cpu": its (token, slot) on the CPU

    def make(name, m, orig):
        key = input_key(name)
        g = flats[key]
        kw = {k: v for k, v in m.input_kwargs.items() if k not in ("scale_rule", "scale_scope")}
        rule = m.input_kwargs.get("scale_rule", "6")
        expert = expert_input(name)

        def quantize_input(x):
            ident = (key, rule, kw, x.data_ptr(), x.shape, x.stride(), x.dtype, x.device, _version(x))
            if last.get("id") == ident:
                return last["q"]
            if expert is None:
                gx, vx = g, valid
            else:  # this expert's rows of the layer's guidance
                rows = _rows_now(name)
                per = rows.top_k if expert[1] else 1  # guidance rows per token
                if g.amax.shape[0] != rows.tokens * per or valid.shape[0] != rows.tokens:
                    raise ValueError(f"TRACE guidance of {key} has {g.amax.shape[0]} rows and valid "
                                     f"{valid.shape[0]}, but {name} runs on {rows.tokens} tokens with {per} "
                                     "row(s) each")
                if here.get("rows") is not rows:  # one device -> host copy per expert call
                    here.update(rows=rows, cpu=rows._replace(token=rows.token.cpu(), slot=rows.slot.cpu()))
                cpu = here["cpu"]
                gx = g.index(_expert_index(cpu, expert[1]).to(g.bits.device))
                vx = valid[cpu.token.to(valid.device)]
            q = guided_quantize(x, gx, vx, scale_rule=rule, stats=stats, name=name, **kw)
            last.update(id=ident, x=x, q=q)
            return q
        return quantize_input

    _patch(mods, make)
    try:
        yield
    finally:
        _unpatch(mods)
        last.clear()
        here.clear()


def _version(x: torch.Tensor) -> int | None:
    """x's in-place version counter (None for an inference tensor, which has none)."""
    return None if x.is_inference() else x._version

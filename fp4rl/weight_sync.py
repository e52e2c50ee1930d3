"""Trainer -> sampler weight sync: a versioned payload of packed NVFP4 + BF16 tensors, checksummed.

`build_payload(trainer_model, contract, version)` ships, for every linear the contract quantizes,
the NVFP4Tensor the trainer's forward computes with (`qat.packed_state`: its cached Q(W), the very
bytes, not a re-quantization): codes 4 bits + E4M3 block scale 8/16 bits + FP32 global scale per
tensor = 4.5 bits per parameter (+ 32/numel). Every other parameter (norms, embeddings, attention
and lm_head when BF16, biases) goes in `dense_dtype` (BF16 by default; pass torch.float32 for a
bit-exact FP32 sampler). Tied parameters travel once.

Integrity. Each tensor has a BLAKE2b-128 checksum over (name, dtype, shape, bytes); the payload's
`digest` hashes the version, the quantizer settings and every checksum in name order. Sealing (computing
them: a copy of every byte to the host and a hash of it) is for payloads that leave their process:
`build_payload(..., seal=False)` makes an unsealed payload for samplers in the same process (the RL loop's),
which `to_bytes` seals before the bytes go anywhere; until then its `digest` is a name unique to the object
(`local_digest`, kept after sealing so that a sampler holding it accepts the sealed re-push).
`apply_payload` (what `Sampler.load` calls) validates everything before it touches a weight:
- the version is not older than the sampler's; an equal version is accepted only as a re-push of
  the payload the sampler holds (same digest: a version names one set of weights);
- the names are exactly the sampler's packed and dense tensors; shapes, dtypes, NVFP4 metadata
  (tile, 4/6 rule) and each packed linear's mode and activation quantizer settings match;
- a sealed payload's checksums and digest recompute to the stored values (a flipped byte is named);
- every dense tensor and packed global scale is finite (no NaN / Inf, e.g. from a diverged trainer; one
  min/max per tensor and one host sync for all of them).
Only then are the tensors copied in place; a refused payload raises ValueError and the sampler
keeps its old weights. With verify=True the sampler's own tensors are hashed again after the
copy and must reproduce the payload's checksums (unsealed: its packed tensors compared byte for byte; a
dense tensor: its bytes in the sampler's dtype, compared byte for byte): the sampler then provably holds the
bytes the trainer's forward quantized
(`verify_equal` checks that directly against a trainer in-process).
A verify failure (VerifyError, a ValueError) comes after the copy, so the old weights are gone:
the Sampler then refuses to generate until a load succeeds; so does any other exception raised once the
copy has begun, by the copy or by verify (KeyboardInterrupt, a device or out-of-memory error:
`weights_touched` set on it).

Transport: `to_bytes()` / `from_bytes()` (and `save` / `load` for files) use safetensors with
the checksums and metadata in its JSON header, ready for Ray object refs or a
torch.distributed broadcast of a uint8 tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from fp4rl.nvfp4 import NVFP4Tensor
from fp4rl.precision import PrecisionContract
from fp4rl.qat import NVFP4Linear, packed_state

PACKED_FIELDS = ("data", "block_scale", "global_scale")
FORMAT = "fp4rl-weight-sync-1"


def tensor_checksum(name: str, t: torch.Tensor) -> str:
    """BLAKE2b-128 hex of (name, dtype, shape, raw bytes) of a tensor."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
    t = t.detach().contiguous().cpu()
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _unreadable(why: str) -> ValueError:
    return ValueError(f"weight sync: these bytes are not a readable fp4rl payload ({why}): refused")


def _packed_items(packed: dict[str, NVFP4Tensor]):
    """(`{name}.{field}`, tensor) for every packed tensor."""
    for name, q in packed.items():
        for f in PACKED_FIELDS:
            yield f"{name}.{f}", getattr(q, f)


@dataclass
class Payload:
    version: int
    packed: dict[str, NVFP4Tensor]  # `{linear}.weight` -> NVFP4Tensor
    dense: dict[str, torch.Tensor]  # every other parameter, HF names
    modes: dict[str, str]  # `{linear}.weight` -> "w4a16" | "w4a4"
    input_kwargs: dict  # the contract's activation quantizer settings (W4A4)
    checksums: dict[str, str] = field(default_factory=dict)
    digest: str = ""
    sealed: bool = False  # checksums and digest computed (seal(), from_bytes); unsealed: never left home
    # a name unique to this object (not carried over by dataclasses.replace, copy or pickle): an unsealed
    # payload's digest
    local_digest: str = field(init=False, repr=False, compare=False)
    # sealed by to_bytes, in this process, from the tensors it holds: those never left, so a load here has
    # nothing to check them against (an async run's Ray pool seals the payload its in-process eval sampler
    # loads too: it was hashed twice). Not carried by copies, as local_digest.
    sealed_to_travel: bool = field(init=False, default=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.sealed and (self.checksums or (self.digest and not self.digest.startswith("local-"))):
            self.sealed = True  # checksums or a content digest given: checked as before (an outside reader)
        self._new_name()

    def _new_name(self) -> None:
        self.local_digest = f"local-{uuid.uuid4().hex}"
        if not self.sealed:
            self.digest = self.local_digest

    def __setstate__(self, state: dict) -> None:  # copy / deepcopy / pickle: another object, another name
        self.__dict__.update(state)
        self.sealed_to_travel = False
        self._new_name()

    # -- integrity ---------------------------------------------------------------------------
    def items(self):
        """(name, tensor) of every tensor the payload ships: `{linear}.weight.{field}` and dense names."""
        yield from _packed_items(self.packed)
        yield from self.dense.items()

    def compute_checksums(self) -> dict[str, str]:
        return {name: tensor_checksum(name, t) for name, t in self.items()}

    def compute_digest(self, checksums: dict[str, str]) -> str:
        h = hashlib.blake2b(digest_size=16)
        header = dict(format=FORMAT, version=self.version, modes=self.modes, input_kwargs=self.input_kwargs,
                      meta=self._packed_meta())
        h.update(json.dumps(header, sort_keys=True).encode())
        for name in sorted(checksums):
            h.update(f"{name}={checksums[name]};".encode())
        return h.hexdigest()

    def seal(self) -> Payload:
        self.checksums = self.compute_checksums()
        self.digest = self.compute_digest(self.checksums)
        self.sealed = True
        return self

    def names_weights(self, digest: str | None) -> bool:
        """Whether `digest` (a sampler's weights_digest) names this payload's weights: its digest, or the
        unique name it had before it was sealed."""
        return digest is not None and digest in (self.digest, self.local_digest)

    def check(self) -> None:
        """Raise ValueError naming the first tensor whose bytes do not hash to its checksum."""
        if not self.sealed:
            raise ValueError(f"weight sync payload v{self.version} is not sealed: it has no checksums to "
                             "check (seal() it, or build it with build_payload(..., seal=True))")
        names = {name for name, _ in self.items()}
        if names != set(self.checksums):
            raise ValueError(f"weight sync payload v{self.version}: checksums list "
                             f"{sorted(set(self.checksums) ^ names)[:5]} that the payload does not hold "
                             "(or the reverse): refused")
        for name, t in self.items():
            if tensor_checksum(name, t) != self.checksums[name]:
                raise ValueError(f"weight sync payload v{self.version}: tensor {name} does not match its "
                                 "checksum (corrupted in transit?): refused, the sampler keeps its weights")
        if self.compute_digest(self.checksums) != self.digest:
            raise ValueError(f"weight sync payload v{self.version}: the payload digest does not match its "
                             "contents (version, settings or checksums altered): refused")

    # -- sizes -------------------------------------------------------------------------------
    @property
    def quantized_params(self) -> int:
        return sum(q.shape.numel() for q in self.packed.values())

    @property
    def packed_bytes(self) -> int:
        return sum(q.nbytes for q in self.packed.values())

    @property
    def dense_bytes(self) -> int:
        return sum(t.nbytes for t in self.dense.values())

    @property
    def nbytes(self) -> int:
        return self.packed_bytes + self.dense_bytes

    @property
    def bits_per_quantized_param(self) -> float:
        return 8 * self.packed_bytes / max(self.quantized_params, 1)

    def summary(self) -> str:
        mib = 2**20
        return (f"payload v{self.version}: {self.nbytes / mib:.2f} MiB = packed "
                f"{self.packed_bytes / mib:.2f} "
                f"MiB ({len(self.packed)} linears, {self.quantized_params:,} params, "
                f"{self.bits_per_quantized_param:.3f} bits/param) + dense {self.dense_bytes / mib:.2f} MiB "
                f"({len(self.dense)} tensors)")

    # -- transport ---------------------------------------------------------------------------
    def _packed_meta(self) -> dict:
        return {name: dict(shape=list(q.shape), dtype=str(q.dtype).removeprefix("torch."),
                           tile=list(q.tile) if isinstance(q.tile, tuple) else q.tile,
                           scale_rule=q.scale_rule, hadamard_seed=q.hadamard_seed)
                for name, q in self.packed.items()}

    def to_bytes(self) -> bytes:
        """safetensors bytes: tensors under their payload names, everything else in the header (an unsealed
        payload is sealed first, in place)."""
        if not self.sealed:
            self.seal()
            self.sealed_to_travel = True
        header = dict(format=FORMAT, version=self.version, modes=self.modes, input_kwargs=self.input_kwargs,
                      packed=self._packed_meta(), checksums=self.checksums, digest=self.digest)
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.items()}
        return st_save(tensors, metadata={"fp4rl": json.dumps(header)})

    @classmethod
    def from_bytes(cls, blob: bytes) -> Payload:
        """The inverse of to_bytes. Checksums are verified when the payload is applied (or by check()).
        Bytes that are not a payload, or whose header lacks a field or holds one of the wrong type, raise
        ValueError ("not a readable fp4rl payload")."""
        try:
            tensors = st_load(bytes(blob))
            header_len = int.from_bytes(blob[:8], "little")
            header = json.loads(json.loads(bytes(blob[8:8 + header_len]))["__metadata__"]["fp4rl"])
        except Exception as e:
            raise _unreadable(str(e)) from e
        if not isinstance(header, dict):
            raise _unreadable(f"its header is a {type(header).__name__}, not a JSON object")
        if header.get("format") != FORMAT:
            raise ValueError(f"weight sync: payload format {header.get('format')!r}, expected {FORMAT!r}")
        for key, kind in (("version", int), ("packed", dict), ("modes", dict), ("input_kwargs", dict),
                          ("checksums", dict), ("digest", str)):
            value = header.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                found = "missing" if value is None else repr(value)[:40]
                raise _unreadable(f"header field {key!r} is {found}, not a {kind.__name__}")
        packed = {}
        for name, meta in header["packed"].items():
            try:
                dtype = meta["dtype"]
                tile = tuple(meta["tile"]) if isinstance(meta["tile"], list) else meta["tile"]
                shape = torch.Size(meta["shape"])
                scale_rule, hadamard_seed = meta["scale_rule"], meta["hadamard_seed"]
            except (KeyError, TypeError, ValueError) as e:
                raise _unreadable(f"the metadata of {name} is malformed ({type(e).__name__}: {e})") from e
            torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else None
            if not isinstance(torch_dtype, torch.dtype):
                raise _unreadable(f"{name} has dtype {dtype!r}, not the name of a torch dtype")
            missing = [f for f in PACKED_FIELDS if f"{name}.{f}" not in tensors]
            if missing:
                raise ValueError(f"weight sync: payload lacks {name}.{missing[0]}: refused")
            packed[name] = NVFP4Tensor(**{f: tensors.pop(f"{name}.{f}") for f in PACKED_FIELDS},
                                       shape=shape, dtype=torch_dtype, tile=tile, scale_rule=scale_rule,
                                       hadamard_seed=hadamard_seed)
        return cls(version=header["version"], packed=packed, dense=tensors, modes=header["modes"],
                   input_kwargs=header["input_kwargs"], checksums=header["checksums"],
                   digest=header["digest"], sealed=True)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "wb") as f:
            f.write(self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Payload:
        with open(path, "rb") as f:
            return cls.from_bytes(f.read())


# ----------------------------------------------------------------------------------------------
# Trainer side


def build_payload(trainer_model: nn.Module, contract: PrecisionContract, version: int, *,
                  dense_dtype: torch.dtype = torch.bfloat16, seal: bool = True) -> Payload:
    """The payload of `trainer_model` (converted with `contract`) at policy `version`.

    Packed tensors are the trainer's cached quantized weights themselves (never modified in place:
    a weight change makes a new Q(W)); dense tensors are copies in dense_dtype. seal=False: no checksums
    (for samplers in this process; `to_bytes` seals it before it travels). An unsealed payload is known by
    its object, not its bytes: two unsealed payloads of the same weights have different digests (ranks of a
    DistributedSampler must load one payload through DistributedSampler.load, which seals it once), and one
    changed in place after a load is not detected (a sealed payload's checksums would be)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"build_payload: version={version!r} must be an integer >= 0")
    resolved = contract.resolve(trainer_model)
    converted = {name: m for name, m in trainer_model.named_modules() if isinstance(m, NVFP4Linear)}
    expected = {name: p for name, p in resolved.items() if p != "bf16"}
    wrong = sorted(set(expected) ^ set(converted)) + sorted(
        n for n in set(expected) & set(converted) if converted[n].mode != expected[n])
    if wrong:
        raise ValueError(f"build_payload: the model was not converted with this contract ({wrong[:3]} "
                         "differ); run qat.convert(model, contract) with the contract the trainer uses")
    kwargs = {m.mode: m.input_kwargs for m in converted.values()}
    input_kwargs = dict(contract.input_quantize_kwargs())
    if any(k != input_kwargs for k in kwargs.values()):
        raise ValueError("build_payload: the converted linears quantize activations with other settings than "
                         "the contract; convert the model again with this contract")
    packed = dict(packed_state(trainer_model))
    skip = set(packed) | {f"{name}.weight" for name in converted}
    dense = {name: p.detach().to(dtype=dense_dtype, copy=True)
             for name, p in trainer_model.named_parameters() if name not in skip}  # tied: once
    modes = {f"{name}.weight": m.mode for name, m in converted.items()}
    payload = Payload(version=version, packed=packed, dense=dense, modes=modes, input_kwargs=input_kwargs)
    return payload.seal() if seal else payload


def verify_equal(sampler_model: nn.Module, trainer_model: nn.Module) -> None:
    """Raise unless every packed linear of the sampler holds, byte for byte, the quantized weight the
    trainer's NVFP4Linear forward uses (its cached Q(W)). Accepts a Sampler or its model."""
    sampler_model = getattr(sampler_model, "model", sampler_model)
    ours = _sampler_packed(sampler_model)
    theirs = packed_state(trainer_model)
    if set(ours) != set(theirs):
        raise ValueError(f"verify_equal: packed linears differ: {sorted(set(ours) ^ set(theirs))[:5]}")
    for name, q in theirs.items():
        for f in PACKED_FIELDS:
            a, b = getattr(ours[name].quantized_weight(), f), getattr(q, f)
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(
                    a.reshape(-1).view(torch.uint8).cpu(), b.reshape(-1).view(torch.uint8).cpu()):
                raise ValueError(f"verify_equal: {name}.{f} in the sampler differs from the bytes the "
                                 "trainer's forward quantized")


# ----------------------------------------------------------------------------------------------
# Sampler side


def _sampler_packed(model: nn.Module) -> dict:
    from fp4rl.sampler import PackedNVFP4Linear

    return {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, PackedNVFP4Linear)}


class VerifyError(ValueError):
    """apply_payload(verify=True): after the copy, the sampler's tensors do not hold the payload's bytes."""


def apply_payload(model: nn.Module, payload: Payload, *, current_version: int, verify: bool = False,
                  current_digest: str | None = None) -> None:
    """Copy `payload` into the sampler's model in place, after validating all of it (see the module
    docstring). Raises ValueError and changes nothing when the payload is refused; VerifyError when
    verify finds other bytes after the copy; anything raised once the copy has begun (VerifyError included)
    carries `weights_touched = True`. current_digest: the digest of the payload the sampler holds
    (None: none loaded yet), which an equal version must repeat."""
    if not isinstance(payload, Payload):
        raise TypeError(f"Sampler.load: expected a weight_sync.Payload, got {type(payload).__name__}")
    if isinstance(payload.version, bool) or not isinstance(payload.version, int):
        raise ValueError(f"weight sync: payload version {payload.version!r} is not an integer: refused")
    if payload.version < current_version:
        raise ValueError(f"weight sync: payload v{payload.version} is older than the sampler's policy "
                         f"v{current_version}: refused (stale), the sampler keeps v{current_version}")
    if payload.version == current_version and current_digest is not None and \
            not payload.names_weights(current_digest):
        if not payload.sealed or current_digest.startswith("local-"):
            raise ValueError(f"weight sync: payload v{payload.version} is not the v{current_version} payload "
                             "the sampler holds, and an unsealed payload is known by its object, not by its "
                             "bytes: refused; push the same payload object again, a newer version, or sealed "
                             "payloads (build_payload(..., seal=True)), whose digests name their bytes")
        raise ValueError(f"weight sync: payload v{payload.version} holds other weights than the "
                         f"v{current_version} the sampler has (digest {payload.digest[:12]} vs "
                         f"{current_digest[:12]}): refused; a version names one set of weights, so a trainer "
                         "that went back (e.g. resumed from an older checkpoint) must push a newer version")
    packed = _sampler_packed(model)
    dense = dict(model.named_parameters())
    for kind, ours, theirs in (("packed", packed, payload.packed), ("dense", dense, payload.dense)):
        if set(ours) != set(theirs):
            missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
            raise ValueError(f"weight sync: payload v{payload.version} {kind} tensors do not match the "
                             f"sampler's model (missing {missing[:3]}, unexpected {extra[:3]}): refused; was "
                             "it built with the same model and precision contract?")
    for name, m in packed.items():
        q, mine = payload.packed[name], m.quantized_weight()
        for f in PACKED_FIELDS:
            a, b = getattr(q, f), getattr(mine, f)
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(f"weight sync: {name}.{f} is {a.dtype} {list(a.shape)} in the payload, the "
                                 f"sampler holds {b.dtype} {list(b.shape)}: refused")
        for key in ("shape", "tile", "scale_rule", "hadamard_seed"):
            if getattr(q, key) != getattr(mine, key):
                raise ValueError(f"weight sync: {name} has {key}={getattr(q, key)!r} in the payload, the "
                                 f"sampler uses {getattr(mine, key)!r}: refused")
        if payload.modes.get(name) != m.mode:
            raise ValueError(f"weight sync: {name} is {payload.modes.get(name)} in the payload, {m.mode} in "
                             "the sampler: refused (precision contracts differ)")
        if m.mode == "w4a4" and payload.input_kwargs != m.input_kwargs:
            raise ValueError(f"weight sync: the payload quantizes activations with {payload.input_kwargs}, "
                             f"the sampler with {m.input_kwargs}: refused (precision contracts differ)")
    for name, p in dense.items():
        t = payload.dense[name]
        if t.shape != p.shape or not t.is_floating_point():
            raise ValueError(f"weight sync: {name} is {t.dtype} {list(t.shape)} in the payload, the sampler "
                             f"holds {p.dtype} {list(p.shape)}: refused")
    # an unsealed payload's tensors never left this process, nor did those of one sealed only to travel:
    # nothing to check them by
    if payload.sealed and not payload.sealed_to_travel:
        payload.check()
    finite = [(f"{name}.global_scale", q.global_scale) for name, q in payload.packed.items()]
    bad = first_nonfinite([*finite, *payload.dense.items()])
    if bad is not None:
        raise ValueError(f"weight sync: payload v{payload.version} tensor {bad} holds non-finite "
                         "values (NaN or Inf: diverged training?): refused, the sampler keeps "
                         f"v{current_version}")

    # validated. From here on the old weights are being overwritten: whatever is raised (an interruption
    # of the copy, Ctrl-C or an out-of-memory error while verifying, a VerifyError) leaves the sampler with
    # weights that are neither the old version nor a verified new one, so Sampler.load marks them unusable
    try:
        with torch.no_grad():
            for name, m in packed.items():
                q = payload.packed[name]
                for f, buffer in zip(PACKED_FIELDS, (m.weight_data, m.weight_block_scale,
                                                     m.weight_global_scale)):
                    buffer.copy_(getattr(q, f))
            for name, p in dense.items():
                p.copy_(payload.dense[name])
        if verify:
            _verify_loaded(packed, dense, payload)
    except BaseException as exc:
        exc.weights_touched = True
        raise


def first_nonfinite(named) -> str | None:
    """The first name of (name, tensor) pairs whose floating-point tensor holds a NaN or an Inf, or None.
    One aminmax per tensor (NaN propagates through both, an Inf is one of them) and one host sync per device
    for all of them, instead of an isfinite pass and a sync per tensor."""
    named = [(n, t) for n, t in named if t.is_floating_point() and t.numel()]
    by_device: dict[torch.device, list] = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)

    def ends_finite(t: torch.Tensor) -> torch.Tensor:  # bool [2], in t's dtype (float64 past fp32's range)
        try:
            ends = torch.aminmax(t)
        except (NotImplementedError, RuntimeError):  # a dtype without aminmax here (e.g. float8 on a CPU)
            ends = torch.aminmax(t.float())  # (exact: every such dtype is narrower than float32)
        return torch.isfinite(torch.stack(ends))

    bad = []
    for idx in by_device.values():
        ok = torch.stack([ends_finite(named[i][1].detach()) for i in idx]).all(dim=1).cpu().tolist()
        bad += [i for i, good in zip(idx, ok) if not good]
    return named[min(bad)][0] if bad else None


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether b (moved to a's device) holds a's bytes: same shape, dtype and raw bytes."""
    b = b.to(a.device)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _verify_loaded(packed: dict, dense: dict, payload: Payload) -> None:
    """Raise VerifyError unless the sampler's tensors hold the payload's bytes (after the copy)."""
    for name, m in packed.items():
        q = m.quantized_weight()
        for f in PACKED_FIELDS:
            if (tensor_checksum(f"{name}.{f}", getattr(q, f)) != payload.checksums[f"{name}.{f}"]
                    if payload.sealed else not _same_bytes(getattr(q, f), getattr(payload.packed[name], f))):
                raise VerifyError(f"weight sync verify: {name}.{f} in the sampler does not hold the "
                                  "payload's bytes after loading")
    for name, p in dense.items():  # by bytes: NaN != NaN and -0.0 == 0.0 as numbers
        if not _same_bytes(p, payload.dense[name].to(dtype=p.dtype)):
            raise VerifyError(f"weight sync verify: {name} in the sampler differs from the payload after "
                              "loading")

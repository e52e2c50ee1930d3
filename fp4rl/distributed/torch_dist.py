"""torch.distributed building blocks for fp4rl: weight-sync broadcast, sharded rollouts, gradient averaging.

SPMD: every rank runs the same script, and every function here is a collective that every rank of the group
must call, in the same order, with the same arguments where the docstrings say so. Launch with torchrun:

    torchrun --nproc-per-node N your_script.py

    import torch.distributed as dist
    from fp4rl.distributed.torch_dist import DistributedSampler

    dist.init_process_group("gloo")  # torchrun sets the env it reads; for "nccl" (GPUs) first
                                     # torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    sampler = DistributedSampler(Sampler(model, tok))  # every rank builds the same sampler, same weights
    for step in range(steps):
        completions = sampler.generate(prompts, params)  # the same prompts and params on every rank;
        # rank r samples shard r; every rank returns the same full list, in prompt order
        if dist.get_rank() == 0:
            ...train on `completions`...
            sampler.load(build_payload(trainer_model, contract, version=step + 1))
        else:
            sampler.load(None)  # receives rank 0's payload
    dist.barrier()  # no rank closes its connections while another is still inside a collective
    dist.destroy_process_group()

Every rank calls load at the same steps (the others with None). A data-parallel trainer (every rank trains
on its part of the batch) calls `average_gradients(model)` on every rank between backward and the optimizer
step; the ranks' models then stay equal and any one of them can build the payload.

The rollout follows fp4rl.distributed.shards (shard r of a world of W ranks is exactly shard r of
`LocalShards(sampler, W)`), so a run's completions depend on the seed and W only: the W ranks return, byte
for byte, what `LocalShards(sampler, W).generate` returns in one process.

Tensors travel on the group's backend: CPU tensors for gloo, tensors of the current CUDA device
(torch.cuda.set_device) for NCCL. Ranks are ranks within `group` (the default group when None).

Failures are made collective where they can be: a rank whose generate or load fails, or ranks called with
different prompts or params, make every rank raise instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import hashlib
import warnings

import torch
import torch.distributed as dist

from fp4rl.distributed.shards import check_prompts, merge, shard_bounds, shard_params
from fp4rl.distributed.wire import from_wire, to_wire
from fp4rl.weight_sync import Payload

CHUNK_BYTES = 256 * 2**20  # bytes per broadcast of a payload
_INIT_HINT = ("call torch.distributed.init_process_group('gloo') (CPU) or ('nccl') (GPU) on every rank "
              "first, or launch the script with torchrun --nproc-per-node N")


def _require_group(what: str, group=None) -> None:
    if not dist.is_available():
        raise RuntimeError(f"{what}: this torch build has no torch.distributed support")
    if not dist.is_initialized():
        raise RuntimeError(f"{what}: the torch.distributed process group is not initialized; {_INIT_HINT}")
    if group is not None and dist.get_rank(group) < 0:
        raise RuntimeError(f"{what}: this rank is not a member of the given process group")


def _device(group=None) -> torch.device:
    """Where this group's collectives take tensors: the current CUDA device for NCCL, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global(rank: int, group) -> int:
    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)


# ----------------------------------------------------------------------------------------------
# Weight sync


def payload_from_bytes(blob: bytes) -> Payload:
    """A received payload: `Payload.from_bytes` then every checksum and the digest verified (ValueError
    naming the first corrupted tensor)."""
    payload = Payload.from_bytes(blob)
    payload.check()
    return payload


def broadcast_payload(payload: Payload | None, src: int = 0, group=None, *,
                      chunk_bytes: int = CHUNK_BYTES) -> Payload:
    """Rank `src` passes its weight_sync.Payload, every other rank None; every rank returns the payload.

    The bytes (`Payload.to_bytes`) go as a uint8 tensor after a [status, length] header, and receivers
    rebuild them with `Payload.from_bytes` and verify every checksum (a corrupted payload raises
    ValueError there). `src` returns the object it passed. If `src` passes None (or something that is not a
    Payload), every rank raises. A payload passed on another rank is ignored with a RuntimeWarning: the
    src rank's bytes are what every rank gets (so SPMD code may pass the same object everywhere).
    The bytes go in broadcasts of at most `chunk_bytes` (every rank must pass the same value).
    """
    payload, blob = _broadcast_bytes(payload, src, group, chunk_bytes)
    return payload if blob is None else payload_from_bytes(blob)


def _broadcast_bytes(payload, src: int, group, chunk_bytes: int) -> tuple[Payload | None, bytes | None]:
    """(payload, None) on `src`, (None, its bytes) on the other ranks; raises on every rank if src fails."""
    _require_group("broadcast_payload", group)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"broadcast_payload: chunk_bytes={chunk_bytes!r} must be an integer >= 1")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(f"broadcast_payload: src={src!r} is not a rank of this group (0..{world - 1})")
    device = _device(group)
    header = torch.zeros(2, dtype=torch.int64, device=device)
    blob, error = None, None
    if rank == src:
        if not isinstance(payload, Payload):
            error = TypeError(f"broadcast_payload: the src rank {src} must pass a weight_sync.Payload, got "
                              f"{type(payload).__name__}; the other ranks pass None")
        else:
            try:
                blob = payload.to_bytes()
            except Exception as e:  # tell the receivers before raising
                error = e
        header[0], header[1] = (1, len(blob)) if error is None else (-1, 0)
    elif payload is not None:
        warnings.warn(f"broadcast_payload: rank {rank} passed a payload but is not the src rank {src}; it is "
                      f"ignored and rank {src}'s payload is received", RuntimeWarning, stacklevel=3)
    dist.broadcast(header, src=_global(src, group), group=group)
    status, length = (int(v) for v in header.tolist())
    if status != 1:
        if rank == src:
            raise error
        raise RuntimeError(f"broadcast_payload: the src rank {src} had no payload to send (it raised); "
                           "nothing was received")
    # the bytes in chunks: NCCL needs at most one chunk of GPU memory, whatever the payload's size
    host = (torch.frombuffer(bytearray(blob), dtype=torch.uint8) if rank == src
            else torch.empty(length, dtype=torch.uint8))
    for start in range(0, length, chunk_bytes):
        part = host[start:start + chunk_bytes]
        data = part if device.type == "cpu" else part.to(device)
        dist.broadcast(data, src=_global(src, group), group=group)
        if data is not part:
            part.copy_(data)
    if rank == src:
        return payload, None
    return None, host.numpy().tobytes()


# ----------------------------------------------------------------------------------------------
# Completions


def all_gather_completions(local: list, group=None) -> list[list]:
    """Every rank's `local` list of Completions, indexed by rank (all_gather_object). Tensors in the
    completions (MoE `routing`, TRACE `guidance`) come back as CPU tensors, dtypes and bytes kept."""
    _require_group("all_gather_completions", group)
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, to_wire(list(local)), group=group)
    return [from_wire(part) for part in out]


# ----------------------------------------------------------------------------------------------
# Sampler


def _fingerprint(prompts, params, version) -> str:
    prompts = list(prompts) if isinstance(prompts, list | tuple) else prompts
    return hashlib.blake2b(repr((prompts, params, version)).encode(), digest_size=16).hexdigest()


class DistributedSampler:
    """A Sampler whose rollouts are sharded over the ranks of a process group (module docstring).

    generate(prompts, params)  every rank passes the same prompts and params; rank r samples shard r with
                               shards.shard_params(params, r); every rank returns the same merged list,
                               equal to LocalShards(sampler, world_size).generate(prompts, params).
    load(payload, verify, src) rank `src` passes the payload, the others None (broadcast_payload); every
                               rank then loads it. If loading fails on any rank, every rank raises (the
                               ranks that loaded are at the new version, the others kept their weights).
    policy_version             the local sampler's.
    Every other attribute is the wrapped sampler's.
    """

    def __init__(self, sampler, group=None):
        _require_group("DistributedSampler", group)
        self.sampler, self.group = sampler, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    @property
    def policy_version(self) -> int:
        return self.sampler.policy_version

    def load(self, payload: Payload | None = None, *, verify: bool = False, src: int = 0,
             chunk_bytes: int = CHUNK_BYTES) -> None:
        # failures of the src rank raise on every rank
        payload, blob = _broadcast_bytes(payload, src, self.group, chunk_bytes)
        error = None
        try:  # a corrupted or mismatched payload is refused locally, then on every rank; the received bytes
            # are hashed once, by Sampler.load (apply_payload checks every checksum before copying)
            self.sampler.load(payload if blob is None else Payload.from_bytes(blob), verify=verify)
        except Exception as e:
            error = e
        self._agree("load", error)

    def generate(self, prompts: list, params) -> list:
        part, error, bounds = [], None, None
        try:  # refused like Sampler.generate, on every rank together (the gather below tells the others)
            check_prompts(prompts)
        except ValueError as e:
            error = e
        if error is None:
            bounds = shard_bounds(len(prompts), self.world_size)
            start, stop = bounds[self.rank]
            if stop > start:
                try:
                    part = self.sampler.generate(prompts[start:stop], shard_params(params, self.rank))
                except Exception as e:
                    error = e
        digest = getattr(self.sampler, "weights_digest", None)  # the payload it holds (None: never loaded)
        mine = (_fingerprint(prompts, params, (self.policy_version, digest)), (self.policy_version, digest),
                None if error is None else f"{type(error).__name__}: {error}")
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, (mine, to_wire(part)), group=self.group)
        failed = [(r, m[2]) for r, (m, _) in enumerate(everyone) if m[2] is not None]
        if failed:
            if error is not None:
                raise error
            raise RuntimeError(f"DistributedSampler.generate failed on rank {failed[0][0]}: {failed[0][1]}")
        if len({m[0] for m, _ in everyone}) != 1:
            versions = [f"v{m[1][0]} {(m[1][1] or 'no payload')[:12]}" for m, _ in everyone]
            raise ValueError("DistributedSampler.generate: the ranks were given different prompts, params "
                             "or hold different weights (per rank: policy version, payload digest: "
                             f"{versions}); every rank must call generate with the same prompts and params "
                             "after the same loads")
        return merge([from_wire(p) for _, p in everyone], bounds)

    def _agree(self, what: str, error: BaseException | None) -> None:
        """Raise on every rank if `what` raised on any."""
        flags = torch.zeros(self.world_size, dtype=torch.int64, device=_device(self.group))
        flags[self.rank] = error is not None
        dist.all_reduce(flags, group=self.group)
        failed = [r for r, f in enumerate(flags.tolist()) if f]
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"DistributedSampler.{what} failed on rank(s) {failed} (see their errors); "
                               f"this rank {self.rank} is at policy v{self.policy_version}")

    def __getattr__(self, name):  # everything else (memory(), tokenizer, ...) is the wrapped sampler's
        if name in ("sampler", "group", "rank", "world_size"):
            raise AttributeError(name)
        return getattr(self.sampler, name)


# ----------------------------------------------------------------------------------------------
# Data-parallel gradients


def average_gradients(module: torch.nn.Module, group=None, *, bucket_bytes: int = 64 * 2**20) -> None:
    """Replace every parameter's .grad by its mean over the group's ranks, in place (all-reduce SUM, then
    divide by the world size), bit-for-bit equal on every rank.

    Parameters are taken in `module.parameters()` order; those whose .grad is None are skipped, so every
    rank must have the same model and the same set of None grads: this is checked first (parameter count,
    which grads are set, their total size) and a mismatch raises RuntimeError on every rank. Grads are
    reduced in flat buckets of one dtype and device (at most `bucket_bytes` each, single larger tensors
    alone), so they must be where the backend reduces them: on the current CUDA device for NCCL."""
    _require_group("average_gradients", group)
    world, device = dist.get_world_size(group), _device(group)
    params = list(module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    if any(g.is_sparse for g in grads):
        raise ValueError("average_gradients: sparse gradients are not supported")
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int64)
    mask_hash = int.from_bytes(hashlib.blake2b(has.numpy().tobytes(), digest_size=6).digest(), "little")
    sig = torch.tensor([len(params), len(grads), sum(g.numel() for g in grads), mask_hash], dtype=torch.int64)
    both = torch.cat([sig, -sig]).to(device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    hi, lo = both[:4].tolist(), [-v for v in both[4:].tolist()]
    if hi != lo:
        raise RuntimeError(
            "average_gradients: the ranks differ in their parameters or in which grads are None "
            f"(parameters {lo[0]}..{hi[0]}, grads {lo[1]}..{hi[1]}, elements {lo[2]}..{hi[2]} across ranks; "
            f"this rank: {sig[:3].tolist()}); every rank must run backward on the same model and reach the "
            "same parameters (zero a grad instead of leaving it None)")
    if world == 1 or not grads:
        return
    buckets: dict[tuple, list[list[torch.Tensor]]] = {}
    sizes: dict[tuple, int] = {}
    for g in grads:  # fixed order: parameters() order within each (device, dtype)
        key = (g.device, g.dtype)
        runs = buckets.setdefault(key, [[]])
        if runs[-1] and sizes[key] + g.nbytes > bucket_bytes:
            runs.append([])
            sizes[key] = 0
        runs[-1].append(g)
        sizes[key] = sizes.get(key, 0) + g.nbytes
    for runs in buckets.values():
        for run in runs:
            flat = torch.cat([g.reshape(-1) for g in run])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(world)
            offset = 0
            for g in run:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

"""Rollouts on a pool of Ray actors, one Sampler each: the RL loop's `distributed.backend = "ray"`.

    pool = RayRolloutPool(SamplerFactory(model, tokenizer, **kwargs), 4, gpus_per_sampler=1)
    pool.load(payload)                       # every actor now holds payload.version
    completions = pool.generate(prompts, params)
    pool.shutdown()                          # or: with RayRolloutPool(...) as pool: ...

The pool duck-types the Sampler interface the loop uses (generate, load, policy_version), like
fp4rl.distributed.shards.LocalShards. A rollout is split by the one sharding and seeding rule of
fp4rl.distributed.shards (contiguous prompt blocks, shard i sampled with shard_seed(seed, i) by actor i),
the shards run in parallel and come back merged in prompt order: the completions equal, byte for byte,
those of `LocalShards(sampler, num_samplers)` on one machine (given the same sampler build and device).

Each actor builds its Sampler by calling `factory()`: any picklable callable, pickled once here (a pickling
error shows at once) and shared by every actor through the object store. `SamplerFactory(model, tokenizer,
contract=..., **kwargs)` is the one for a model: it carries the model's config and contract only, and the
first payload fills the weights (without a contract it carries the model as torch.save bytes, since plain
pickling of FP8 tensors, which NVFP4 scales are, fails in torch). Weight sync ships `Payload.to_bytes()`
through the object store once per version; every actor decodes it and loads it (checksums verified by
Sampler.load). Ray is imported only here: `pip install 'fp4rl[dist]'`.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from collections.abc import Callable

from fp4rl.distributed.shards import merge, shard_bounds, shard_params
from fp4rl.distributed.wire import from_wire

__all__ = ["RayRolloutPool", "SamplerActorError", "SamplerFactory", "import_ray"]

INSTALL_HINT = "pip install 'fp4rl[dist]'"


def import_ray():
    """The ray module, or ImportError saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"the Ray rollout pool needs Ray: {INSTALL_HINT} (or pip install 'ray>=2.40')") \
            from e
    return ray


class SamplerActorError(RuntimeError):
    """A call on one of the pool's actors failed; `index` is the actor (= shard) index."""

    def __init__(self, index: int, count: int, what: str, cause: BaseException):
        self.index = index
        super().__init__(f"RayRolloutPool: sampler actor {index} of {count} failed in {what}: "
                         f"{type(cause).__name__}: {cause}")


class SamplerFactory:
    """`Sampler(model, tokenizer, **kwargs)` as a picklable callable, shipped to the actors one of two ways:

    - contract=None: the model itself, as torch.save bytes (loaded on the CPU; the Sampler copies it to its
      device), so FP8 tensors (NVFP4 block scales, cached quantized weights) survive, which plain pickling of
      torch tensors does not. Every actor gets the whole master model (fine for small models).
    - contract given (the PrecisionContract the model was converted with): only the model's config, its
      master dtype and the contract travel; each actor builds the model with zero weights and converts it,
      and its weights come from the first payload the pool loads. Nothing of the weights is pickled, so this
      is the way for large models; the RL loop uses it (it loads a payload into the pool before any
      rollout). An actor's sampler samples from zero weights until then.
    Called in this process, the factory builds the Sampler from `model` itself either way."""

    def __init__(self, model, tokenizer=None, *, contract=None, **sampler_kwargs):
        self.model, self.tokenizer, self.contract = model, tokenizer, contract
        self.sampler_kwargs, self._shape = sampler_kwargs, None

    def __call__(self):
        from fp4rl.sampler import Sampler

        if self.model is not None:
            return Sampler(self.model, self.tokenizer, **self.sampler_kwargs)
        sampler = Sampler(self._empty_model(), self.tokenizer, **self.sampler_kwargs)
        # its weights are zeros of the model's shape, whatever policy_version the settings name: it must not
        # sample (and label a zero model's completions with that version) until a payload is loaded
        sampler.weights_error = "no weights loaded yet (built from the model's shape with zero weights)"
        return sampler

    def _empty_model(self):
        import torch

        from fp4rl.model import CausalLM, rope_inv_freq
        from fp4rl.qat import convert

        config, dtype = self._shape
        # in the sampler's dtype when it names one: the zeros are only a shape for the first payload to fill,
        # and a master-dtype (fp32) model of a large config would hold twice the host memory per actor
        dtype = self.sampler_kwargs.get("dtype") or dtype
        with torch.device("meta"):
            model = CausalLM(config)
        model = model.to_empty(device="cpu").to(dtype)
        model.model.rope_inv_freq = rope_inv_freq(config)  # fp32, computed (not a parameter)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        return convert(model.eval(), self.contract)

    def __getstate__(self) -> dict:
        import torch

        state = {"tokenizer": self.tokenizer, "sampler_kwargs": self.sampler_kwargs,
                 "contract": self.contract}
        if self.contract is not None:
            model = self.model
            shape = self._shape if model is None else (model.config, next(model.parameters()).dtype)
            return {**state, "model": None, "shape": shape}
        buf = io.BytesIO()
        torch.save(self.model, buf)
        return {**state, "model": buf.getvalue(), "shape": None}

    def __setstate__(self, state: dict) -> None:
        import torch

        self.tokenizer, self.sampler_kwargs = state["tokenizer"], state["sampler_kwargs"]
        self.contract, self._shape = state["contract"], state["shape"]
        blob = state["model"]
        self.model = None if blob is None else torch.load(io.BytesIO(blob), map_location="cpu",
                                                          weights_only=False)


class _SamplerActor:
    """What runs inside each Ray actor: one Sampler built by the pickled factory."""

    def __init__(self, factory_bytes: bytes, threads: int | None):
        import pickle

        if threads:
            import torch

            torch.set_num_threads(threads)
        self.sampler = pickle.loads(factory_bytes)()

    def ready(self) -> tuple[int, int]:
        return os.getpid(), self.sampler.policy_version

    def generate(self, prompts: list, params) -> list:
        from fp4rl.distributed.wire import to_wire

        return to_wire(self.sampler.generate(prompts, params))  # float8 guidance tensors do not pickle

    def load(self, blob: bytes, verify: bool) -> int:
        from fp4rl.weight_sync import Payload

        self.sampler.load(Payload.from_bytes(blob), verify=verify)
        return self.sampler.policy_version

    def getattr(self, name: str):
        return getattr(self.sampler, name)


class RayRolloutPool:
    """`num_samplers` Ray actors, each holding the Sampler that `factory()` builds (module docstring).

    factory           picklable callable returning a fp4rl Sampler (e.g. functools.partial(Sampler, model,
                      tokenizer, kv_cache=..., device=...)); called once in every actor.
    num_samplers      actors = shards of every rollout (>= 1).
    gpus_per_sampler  Ray num_gpus of each actor (0: CPU actors; fractions share a GPU).
    cpus_per_sampler  Ray num_cpus each actor reserves (default 0: any number of samplers fits the cluster,
                      as Ray's default of 1 would hold one CPU per actor and leave more actors than CPUs
                      pending; GPUs are reserved by gpus_per_sampler).
    torch_threads     torch.set_num_threads in each actor (None: Ray's setting, OMP_NUM_THREADS). CPU
                      samplers: a float result depends on the thread count (the GEMMs split their sums by
                      thread), so equal completions to a local sampler need its thread count
                      (torch.get_num_threads()).
    ray_init_kwargs   passed to ray.init when Ray is not initialized yet (e.g. address="auto"); the pool
                      then owns that Ray session and shuts it down in shutdown().
    startup_timeout_s how long the actors may take to start (waiting on cluster resources included).
    """

    def __init__(self, factory: Callable, num_samplers: int, *, gpus_per_sampler: float = 0.0,
                 cpus_per_sampler: float = 0.0, torch_threads: int | None = None,
                 ray_init_kwargs: dict | None = None, startup_timeout_s: float = 600.0):
        if not callable(factory):
            raise TypeError(f"RayRolloutPool: factory must be a picklable callable that returns a Sampler "
                            f"(e.g. functools.partial(Sampler, model, tokenizer, ...)), got "
                            f"{type(factory).__name__}")
        if not isinstance(num_samplers, int) or isinstance(num_samplers, bool) or num_samplers < 1:
            raise ValueError(f"RayRolloutPool: num_samplers must be an integer >= 1, got {num_samplers!r}")
        if isinstance(gpus_per_sampler, bool) or not isinstance(gpus_per_sampler, int | float) \
                or gpus_per_sampler < 0:
            raise ValueError(f"RayRolloutPool: gpus_per_sampler must be a number >= 0, got "
                             f"{gpus_per_sampler!r}")
        ray = self._ray = import_ray()
        self.num_samplers = num_samplers
        self._lock = threading.RLock()
        self._actors: list = []
        self._owns_ray = False
        if not ray.is_initialized():
            ray.init(**{"ignore_reinit_error": True, **(ray_init_kwargs or {})})
            self._owns_ray = True
        self._broken: str | None = None
        self._dead: str | None = None  # an actor died: nothing but a new pool helps
        try:
            cluster = os.environ.get("RAY_ADDRESS") or (ray_init_kwargs or {}).get("address")
            if self._owns_ray and not cluster and gpus_per_sampler > 0:  # local: no autoscaler adds GPUs
                have = ray.cluster_resources().get("GPU", 0)
                if num_samplers * gpus_per_sampler > have + 1e-9:
                    need = num_samplers * gpus_per_sampler
                    raise ValueError(f"RayRolloutPool: {num_samplers} samplers x {gpus_per_sampler:g} GPU "
                                     f"need {need:g} GPUs, this machine's Ray session has {have:g}: lower "
                                     "distributed.samplers or distributed.gpus_per_sampler (fractions share "
                                     "a GPU), or connect to a cluster (RAY_ADDRESS)")
            options = {"num_gpus": gpus_per_sampler, "num_cpus": cpus_per_sampler}
            actor_cls = ray.remote(_SamplerActor)
            try:
                blob = ray.cloudpickle.dumps(factory)
            except Exception as e:
                raise TypeError(f"RayRolloutPool: the factory cannot be pickled ({type(e).__name__}: {e}); "
                                "for a model use SamplerFactory(model, tokenizer, **sampler_kwargs)") from e
            factory_ref = ray.put(blob)  # once, shared by every actor
            self._actors = [actor_cls.options(**options).remote(factory_ref, torch_threads)
                            for _ in range(num_samplers)]
            started = self._get([a.ready.remote() for a in self._actors], "startup",
                                timeout=startup_timeout_s, options=options)
            versions = {v for _, v in started}
            if len(versions) != 1:
                raise RuntimeError(f"RayRolloutPool: the actors' samplers start at different policy versions "
                                   f"{sorted(versions)}; the factory must build the same sampler every call")
            self._version = versions.pop()
            self.pids = [pid for pid, _ in started]
        except BaseException:
            self.shutdown()
            raise

    # -- helpers -----------------------------------------------------------------------------
    def _get(self, refs: list, what: str, *, timeout: float | None = None,
             options: dict | None = None) -> list:
        """The results of one ref per actor (None: that actor was not called), taken as they finish, so the
        first failure is reported when it happens (not after the actors before it finish); failures are
        named by actor index. An actor that died marks the pool broken (its next generate refuses)."""
        ray = self._ray
        pending = {ref: i for i, ref in enumerate(refs) if ref is not None}
        results: dict[int, object] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not done:
                i = min(pending.values())
                raise SamplerActorError(i, len(refs), what, TimeoutError(
                    f"not done after {timeout:g} s; does the cluster have the resources for "
                    f"{len(refs)} actors of {options or {}} each (ray.cluster_resources(): "
                    f"{ray.cluster_resources()})?"))
            for ref in done:
                i = pending.pop(ref)
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    if isinstance(e, ray.exceptions.RayActorError):
                        self._dead = f"sampler actor {i} died ({type(e).__name__})"
                    cause = getattr(e, "cause", None)
                    cause = cause if isinstance(cause, BaseException) else e
                    raise SamplerActorError(i, len(refs), what, cause) from e
        return [results.get(i) for i in range(len(refs))]

    def _check_open(self, loading: bool = False) -> None:
        if not self._actors:
            raise RuntimeError("RayRolloutPool: the pool is shut down")
        if self._dead:
            raise RuntimeError(f"RayRolloutPool: {self._dead}; shut the pool down and build a new one")
        if self._broken and not loading:
            raise RuntimeError(f"RayRolloutPool: {self._broken}; load a payload every actor accepts, or shut "
                               "the pool down and build a new one")

    # -- the Sampler interface of the loop ---------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    def generate(self, prompts: list, params) -> list:
        """Completions of every prompt x params.n in prompt order, each shard sampled by its actor."""
        if not isinstance(prompts, list | tuple) or not prompts:
            raise ValueError("generate: prompts must be a non-empty list of prompts, each a list of token "
                             "ids or a str")
        with self._lock:
            self._check_open()
            bounds = shard_bounds(len(prompts), self.num_samplers)
            refs = [actor.generate.remote(list(prompts[a:b]), shard_params(params, i)) if b > a else None
                    for i, (actor, (a, b)) in enumerate(zip(self._actors, bounds))]
            parts = self._get(refs, "generate")
        return merge([from_wire(p) if p else [] for p in parts], bounds)

    def load(self, payload, *, verify: bool = False) -> None:
        """Every actor loads `payload` (a weight_sync.Payload), shipped once through the object store."""
        from fp4rl.weight_sync import Payload

        if not isinstance(payload, Payload):
            raise TypeError(f"RayRolloutPool.load: expected a weight_sync.Payload, got "
                            f"{type(payload).__name__}")
        with self._lock:
            self._check_open(loading=True)
            blob = self._ray.put(payload.to_bytes())
            try:
                versions = self._get([a.load.remote(blob, verify) for a in self._actors],
                                     f"load (v{payload.version})")
            except SamplerActorError:
                # some actors may have loaded it: a pool whose actors hold different versions must not sample
                try:
                    now = self._get([a.getattr.remote("policy_version") for a in self._actors], "version")
                except Exception:  # noqa: BLE001 - an actor is gone: the pool cannot sample consistently
                    now = None
                if now is None or set(now) != {self._version}:
                    self._broken = (f"a failed load of v{payload.version} left the actors at versions "
                                    f"{now if now is not None else 'unknown'}")
                raise
            if set(versions) != {payload.version}:
                self._broken = f"after loading v{payload.version} the actors hold versions {versions}"
                raise RuntimeError(f"RayRolloutPool: {self._broken}")
            self._version, self._broken = payload.version, None

    def sampler_attr(self, name: str) -> list:
        """`getattr(sampler, name)` of every actor's sampler (e.g. "max_seq_len", or a method's result via
        a picklable attribute)."""
        with self._lock:
            self._check_open()
            return self._get([a.getattr.remote(name) for a in self._actors], f"getattr({name!r})")

    # -- lifetime ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill the actors (and end the Ray session if this pool started it). Idempotent."""
        ray = self._ray
        actors, self._actors = self._actors, []
        for actor in actors:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(actor)
        if self._owns_ray:
            self._owns_ray = False
            ray.shutdown()

    def __enter__(self) -> RayRolloutPool:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            if self._actors and self._ray.is_initialized():
                self.shutdown()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"RayRolloutPool({self.num_samplers} samplers, policy_version={self._version})"

"""Rollout sharding shared by every scale-out backend (fp4rl.distributed).

A rollout of P prompts over S samplers: shard i takes a contiguous block of prompts (sizes differ by at most
one, the first P mod S shards one larger), samples it with its own seed, and the shards' completions are put
back in prompt order (`Completion.prompt_index` made global again). The seed of shard i is
`shard_seed(seed, i)`: shard 0 keeps the run's seed (one shard is exactly `Sampler.generate`), the others get
seeds derived from it. So the completions depend on the seed and S only (given the same build, device model
and CPU thread count), never on which backend ran the shards, in which order, or on how many machines:
in-process (`LocalShards`), Ray actors (fp4rl.distributed.ray_pool) and torch.distributed ranks
(fp4rl.distributed.torch_dist) give the same bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio): distinct shards get far-apart seeds
_MASK = (1 << 63) - 1


def shard_bounds(n_prompts: int, shards: int) -> list[tuple[int, int]]:
    """[(start, stop)] of each shard's prompts; empty shards (more shards than prompts) are (k, k)."""
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"shards must be an integer >= 1, got {shards!r}")
    if n_prompts < 0:
        raise ValueError(f"n_prompts must be >= 0, got {n_prompts}")
    base, extra = divmod(n_prompts, shards)
    out, start = [], 0
    for i in range(shards):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def shard_seed(seed: int | None, index: int) -> int | None:
    """The sampling seed of shard `index`: the seed itself for shard 0, a derived one for the others, None
    (a fresh seed per shard) when the run gives none."""
    if seed is None:
        return None
    if index == 0:
        return seed
    return ((seed + 1) * _MIX + index * (_MIX >> 1 | 1)) & _MASK


def shard_params(params, index: int):
    """SamplingParams of shard `index` (only the seed changes)."""
    return dataclasses.replace(params, seed=shard_seed(params.seed, index))


def merge(parts: Sequence[list], bounds: Sequence[tuple[int, int]]) -> list:
    """The shards' completions (each in its own prompt order) as one list in global prompt order."""
    if len(parts) != len(bounds):
        raise ValueError(f"merge: {len(parts)} shard results for {len(bounds)} shards")
    out = []
    for part, (start, stop) in zip(parts, bounds):
        for c in part:
            if not 0 <= c.prompt_index < stop - start:
                raise ValueError(f"merge: a completion of shard [{start}, {stop}) has prompt_index "
                                 f"{c.prompt_index}, outside its {stop - start} prompts")
            out.append(dataclasses.replace(c, prompt_index=c.prompt_index + start))
    return out


def check_prompts(prompts) -> None:
    """Raise ValueError (as `Sampler.generate` does) unless `prompts` is a non-empty list or tuple."""
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError("generate: prompts must be a non-empty list of prompts, each a list of token ids or "
                         "a str")


def generate_sharded(generate: Callable[[int, list, object], list], prompts: list, params,
                     shards: int) -> list:
    """Sequential reference of a sharded rollout: `generate(i, prompts_i, params_i)` for every non-empty
    shard, merged in prompt order."""
    bounds = shard_bounds(len(prompts), shards)
    parts = [generate(i, prompts[a:b], shard_params(params, i)) if b > a else []
             for i, (a, b) in enumerate(bounds)]
    return merge(parts, bounds)


class LocalShards:
    """A Sampler whose rollouts are split into `shards` shards run one after the other in this process: the
    same completions as S samplers on S machines (module docstring), on one. Duck-types the Sampler
    interface the RL loop uses (generate, load, policy_version)."""

    def __init__(self, sampler, shards: int):
        shard_bounds(0, shards)  # validates shards
        self.sampler, self.shards = sampler, shards

    @property
    def policy_version(self) -> int:
        return self.sampler.policy_version

    def load(self, payload, *, verify: bool = False) -> None:
        self.sampler.load(payload, verify=verify)

    def generate(self, prompts: list, params) -> list:
        check_prompts(prompts)  # as Sampler.generate: no prompts is a mistake, not an empty rollout
        return generate_sharded(lambda _i, p, sp: self.sampler.generate(p, sp), prompts, params, self.shards)

    def __getattr__(self, name):  # everything else (memory(), tokenizer, ...) is the wrapped sampler's
        if name in ("sampler", "shards"):
            raise AttributeError(name)
        return getattr(self.sampler, name)

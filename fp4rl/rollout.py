"""The rollout side of the RL loop (fp4rl.loop): a step's rollout (generate, encode, score), held-out
evaluation, the training Batch with its GRPO advantages, the background thread of an async run, and the
rollout sampler a run's [distributed] section asks for.

Seeds. Every draw is seeded from trainer.seed by `derive_seed`: a rollout's sampling from (seed, "rollout",
step), a held-out eval's from (seed, "eval", step, T, chunk). A rollout depends only on the policy version
that samples it (`rollout_version`, the schedule in fp4rl.loop's docstring) and on its seed, never on thread
timing, so an async run is as deterministic as a sync one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp4rl.batch import Batch
from fp4rl.config import RunConfig
from fp4rl.distributed.shards import LocalShards
from fp4rl.grpo import group_advantages, reward_metrics
from fp4rl.tasks import Prompt, Task, apply_chat_template

EVAL_CHUNK = 64  # held-out prompts per generate call


def derive_seed(seed: int, *parts) -> int:
    """A 63-bit seed from (seed, parts...), stable across processes and Python versions."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def rollout_version(step: int, staleness: int) -> int:
    """The policy version that samples the rollout of `step` (from 1): max(0, step - 1 - staleness)."""
    return max(0, step - 1 - staleness)


# ---------------------------------------------------------------------------------- rollout


@dataclass
class Rollout:
    """Completions of one step: G prompts x n samples, grouped by prompt, and their rewards (None until
    scored: an async rollout is scored by the trainer's thread, Rollouts.scored)."""

    step: int
    prompts: list[Prompt]  # [G]
    completions: list  # [G * n] fp4rl.sampler.Completion, prompt-major
    rewards: torch.Tensor | None  # [G, n] fp32
    seconds: float  # generation + scoring wall time

    def state_dict(self) -> dict:
        """Plain data (for a checkpoint): the prompts by id, the completions as dicts (and the rewards, or
        None: a pending async rollout is scored when the resumed run takes it)."""
        return {"step": self.step, "prompt_ids": [p.id for p in self.prompts],
                "completions": [dataclasses.asdict(c) for c in self.completions],
                "rewards": self.rewards, "seconds": self.seconds}

    @classmethod
    def from_state_dict(cls, state: dict, task: Task, prompts_per_step: int) -> Rollout:
        from fp4rl.sampler import Completion

        prompts = task.batch(state["step"] - 1, prompts_per_step)
        if [p.id for p in prompts] != state["prompt_ids"]:
            raise ValueError(f"the checkpoint's rollout of step {state['step']} was made for other prompts "
                             "than the task gives now: was task.* changed before resuming?")
        return cls(state["step"], prompts, [Completion(**c) for c in state["completions"]], state["rewards"],
                   state["seconds"])


class Rollouts:
    """Generate, encode and score; shared by the training rollouts and held-out eval."""

    def __init__(self, task: Task, tokenizer, config: RunConfig):
        self.task, self.tokenizer, self.config = task, tokenizer, config
        self._ids: dict[str, list[int]] = {}

    def encode(self, prompt: Prompt) -> list[int]:
        if prompt.id not in self._ids:
            self._ids[prompt.id] = apply_chat_template(self.tokenizer, prompt.question,
                                                       system=self.config.task.system, tokenize=True)
        return self._ids[prompt.id]

    def generate(self, sampler, prompts: list[Prompt], params) -> list:
        completions = sampler.generate([self.encode(p) for p in prompts], params)
        return sorted(completions, key=lambda c: (c.prompt_index, c.sample_index))

    def score(self, prompts: list[Prompt], completions: list) -> list[float]:
        rewards = self.task.score([prompts[c.prompt_index] for c in completions],
                                  [c.text for c in completions])
        if not self.config.task.partial_credit:
            rewards = [1.0 if r >= 1.0 else 0.0 for r in rewards]
        return rewards

    def rollout(self, sampler, step: int, *, score: bool = True) -> Rollout:
        """The rollout of `step`; with score=False its rewards are left for `scored` (the async thread)."""
        from fp4rl.sampler import SamplingParams

        start = time.perf_counter()
        c = self.config
        prompts = self.task.batch(step - 1, c.task.prompts_per_step)
        params = SamplingParams(n=c.sampler.n, temperature=c.sampler.temperature, top_p=c.sampler.top_p,
                                top_k=c.sampler.top_k, max_new_tokens=c.sampler.max_new_tokens,
                                seed=derive_seed(c.trainer.seed, "rollout", step),
                                guidance=c.precision.trace_deep_fraction if c.precision.trace else 0.0)
        completions = self.generate(sampler, prompts, params)
        rollout = Rollout(step, prompts, completions, None, time.perf_counter() - start)
        return self.scored(rollout) if score else rollout

    def scored(self, rollout: Rollout) -> Rollout:
        """`rollout` with its rewards (task.score here, in the caller's thread; once)."""
        if rollout.rewards is None:
            start = time.perf_counter()
            rewards = torch.tensor(self.score(rollout.prompts, rollout.completions), dtype=torch.float32)
            rollout.rewards = rewards.view(len(rollout.prompts), self.config.sampler.n)
            rollout.seconds += time.perf_counter() - start
        return rollout

    def evaluate(self, sampler, step: int) -> dict[str, float]:
        """Held-out accuracy at every eval temperature (0: greedy)."""
        from fp4rl.sampler import SamplingParams

        c = self.config
        prompts = self.task.eval
        out: dict[str, float] = {}
        if not prompts:
            return out
        start = time.perf_counter()
        for temperature in c.eval.temperatures:
            correct, lengths = 0, 0
            for i in range(0, len(prompts), EVAL_CHUNK):
                chunk = prompts[i : i + EVAL_CHUNK]
                # a seed per chunk: with one, row j of every chunk would draw the same random numbers
                params = SamplingParams(
                    n=1, greedy=temperature == 0, temperature=temperature or 1.0, top_p=c.sampler.top_p,
                    top_k=c.sampler.top_k, max_new_tokens=c.eval.max_new_tokens or c.sampler.max_new_tokens,
                    seed=derive_seed(c.trainer.seed, "eval", step, temperature, i // EVAL_CHUNK))
                completions = self.generate(sampler, chunk, params)
                correct += sum(r >= 1.0 for r in self.score(chunk, completions))
                lengths += sum(len(x.completion_ids) for x in completions)
            suffix = "" if temperature == 0 else f"_t{temperature:g}"
            out[f"eval/accuracy{suffix}"] = correct / len(prompts)
            out[f"eval/length_mean{suffix}"] = lengths / len(prompts)
        out["time/eval_s"] = time.perf_counter() - start
        return out


def make_batch(rollout: Rollout, config: RunConfig, pad_id: int) -> tuple[Batch, dict[str, float]]:
    """GRPO advantages of a rollout -> (the training Batch, reward/* and response/* metrics)."""
    g = config.grpo
    for i, c in enumerate(rollout.completions):  # before any group is dropped: an all-NaN rollout scores 0
        if not all(map(math.isfinite, c.logprobs)):  # everywhere and would leave nothing for the loss to see
            raise ValueError(f"the sampler's logprobs of completion {i} (prompt {c.prompt_index}, sample "
                             f"{c.sample_index}) are NaN or Inf: it saw non-finite logits; check the synced "
                             "weights (weight_sync verify=True) and the rollout's model before training on "
                             "it")
    advantages, zero_variance = group_advantages(rollout.rewards, normalize_std=g.normalize_std,
                                                 eps=g.adv_eps)
    n = rollout.rewards.shape[1]
    keep = [i for i in range(len(rollout.completions))
            if not (g.skip_zero_variance_groups and zero_variance[i // n])]
    batch = Batch.from_completions([rollout.completions[i] for i in keep],
                                   advantages.flatten()[keep], pad_id=pad_id)
    lengths = [len(x.completion_ids) for x in rollout.completions]
    truncated = sum(x.finish_reason == "length" for x in rollout.completions)
    metrics = reward_metrics(rollout.rewards, rollout.rewards >= 1.0, zero_variance)
    metrics.update({
        "response/length_mean": sum(lengths) / len(lengths),
        "response/length_max": max(lengths),
        "response/truncated_frac": truncated / len(lengths),
        "time/rollout_s": rollout.seconds,
    })
    return batch, metrics


# ---------------------------------------------------------------------------------- async and sharded


WORKER_CLOSE_S = 5.0  # how long train()'s exit waits for the rollout thread to finish a rollout


class RolloutWorker:
    """Background thread that owns a sampler and produces rollouts in step order (fp4rl.loop's docstring).

    `get(step)` blocks until the rollout of `step` exists; `publish(version, payload)` hands
    the trainer's weights of `version` to the thread.
    """

    def __init__(self, sampler, produce: Callable[[object, int], Rollout], *, staleness: int,
                 first_step: int, last_step: int, ready: dict[int, Rollout] | None = None):
        self.sampler, self.produce, self.staleness = sampler, produce, staleness
        self.ready: dict[int, Rollout] = dict(ready or {})
        self.payloads: dict[int, object] = {}
        self.error: BaseException | None = None
        self.stopped = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._work, args=(first_step, last_step), daemon=True,
                                       name="fp4rl-rollout")
        self.thread.start()

    def _work(self, first_step: int, last_step: int) -> None:
        try:
            for step in range(first_step, last_step + 1):
                version = rollout_version(step, self.staleness)
                if version < self.sampler.policy_version:  # only later versions are ever published
                    raise RuntimeError(f"the rollout of step {step} needs policy version {version}, older "
                                       f"than the sampler's {self.sampler.policy_version}")
                with self.cond:
                    self.cond.wait_for(lambda v=version: self.stopped or self.sampler.policy_version == v
                                       or v in self.payloads)
                    if self.stopped:
                        return
                    payload = self.payloads.get(version)
                    for old in [v for v in self.payloads if v <= version]:
                        del self.payloads[old]  # later steps need later versions only
                if self.sampler.policy_version != version:
                    self.sampler.load(payload)
                rollout = self.produce(self.sampler, step)
                with self.cond:
                    self.ready[step] = rollout
                    self.cond.notify_all()
        except BaseException as e:  # surfaced to the trainer thread by get()/wait()
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _wait(self, steps) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.error is not None or all(s in self.ready for s in steps))
            if self.error is not None:
                raise RuntimeError("the rollout thread failed") from self.error

    def get(self, step: int) -> Rollout:
        self._wait([step])
        with self.cond:
            return self.ready.pop(step)

    def pending(self, steps) -> dict[int, Rollout]:
        """The rollouts of `steps` once they exist (for a checkpoint); they stay queued."""
        self._wait(steps)
        with self.cond:
            return {s: self.ready[s] for s in steps}

    def publish(self, version: int, payload) -> None:
        with self.cond:
            self.payloads[version] = payload
            self.cond.notify_all()

    def close(self, timeout: float | None = None) -> bool:
        """Stop the thread: it returns before its next rollout. A rollout in progress is not interrupted:
        with a timeout, close returns after it even if the thread is still in one (a daemon thread; a Ray
        pool shut down next makes its wait raise). -> whether the thread has ended."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join(timeout)
        return not self.thread.is_alive()


def rollout_sampler(model, tokenizer, sampler_kwargs: dict, config: RunConfig, stack: contextlib.ExitStack,
                    contract=None):
    """The rollout sampler of a run ([distributed]): one Sampler; LocalShards of one Sampler (backend
    "local", samplers > 1); or a RayRolloutPool of `samplers` actors, each building its Sampler from
    `model`'s config converted with `contract` (zero weights until the payload the caller loads next; without
    a contract, from a pickled copy of `model`) and the same keyword arguments, shut down when `stack`
    closes. Every choice with the same number of samplers gives the same completions
    (fp4rl.distributed.shards)."""
    from fp4rl.sampler import Sampler

    d = config.distributed
    if d.backend == "ray":
        from fp4rl.distributed.ray_pool import RayRolloutPool, SamplerFactory

        cpu = torch.device(sampler_kwargs.get("device", "cpu")).type == "cpu"
        # with the contract only the model's config travels: each actor builds it empty, and the payload
        # the caller loads next fills every weight (no copy of the master model per actor)
        factory = SamplerFactory(model, tokenizer, contract=contract, **sampler_kwargs)
        pool = RayRolloutPool(factory, d.samplers, gpus_per_sampler=d.gpus_per_sampler,
                              torch_threads=torch.get_num_threads() if cpu else None)
        stack.callback(pool.shutdown)
        return pool
    sampler = Sampler(model, tokenizer, **sampler_kwargs)
    return LocalShards(sampler, d.samplers) if d.samplers > 1 else sampler


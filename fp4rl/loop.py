"""The RL loop: rollout in NVFP4, score, GRPO update, weight sync; `fp4rl train`.

One step s = 1, 2, ..., trainer.steps:

    prompts   = task.batch(s - 1)                         task.prompts_per_step questions
    rollout   = sampler.generate(prompts, n)              sampler.n completions each, seed (seed, s)
    rewards   = task.score(...)                           -> group advantages (fp4rl.grpo)
    batch     = Batch.from_completions(kept groups)       zero-variance groups dropped (if configured)
    metrics   = trainer.step(batch)                       policy_version s - 1 -> s
    payload   = weight_sync.build_payload(trainer)        packed NVFP4 + the BF16 rest (unsealed: no
                                                          checksums until to_bytes, which a Ray pool or
                                                          torch.distributed sampler calls)
    sampler.load(payload)                                  the sampler now holds version s

Versions. policy_version v is the policy after v trainer steps (v = 0: the initial model).
Every completion carries the version that sampled it, and the step logs its staleness:
trainer version when training on it (s - 1) minus the version that sampled it.

Synchronous (loop.mode = "sync", or async with max_staleness = 0): the rollout of step s
uses version s - 1, so every sample is on-policy (staleness 0).

Asynchronous with k = loop.max_staleness >= 1: the rollout of step s uses version

    v(s) = max(0, s - 1 - k)

A background thread owns the sampler and produces rollouts in step order; for step s it
waits until version v(s) has been published, loads it, and generates. The trainer's thread scores
them (task.score) when it takes them, so a reward that only works in the main thread (math-verify's
signal.alarm timeouts) or is not thread-safe runs as in a sync run. The trainer publishes
version s right after step s, so while it trains step s the thread can already generate the
rollouts of steps s + 1 .. s + k (those need versions <= s - 1, all published). Staleness is exactly
k from step s = k + 1 on (smaller in the first steps, which all use version 0), never more. Because a rollout
depends only on v(s) and its per-step seed, never on thread timing, an async run is as
deterministic as a sync one. A checkpoint after step s waits for the rollouts of steps
s + 1 .. s + k (they need versions <= s - 1, all published) and stores them, so a resumed run
trains on exactly the data the uninterrupted one would have. That holds after the last step
too: the thread makes the k rollouts past trainer.steps (k rollouts more per run) for the final
checkpoint, so a finished run resumed with a larger trainer.steps continues as one run of the
larger step count would have (the sampler cannot go back to versions < s once resumed).

Held-out evaluation uses the trainer's current weights (the rollout sampler in sync mode, a
second sampler in this process in async mode, sharded as the rollouts are): greedy accuracy as
`eval/accuracy` and sampled accuracy at each other temperature T of eval.temperatures as
`eval/accuracy_t{T}`, before step 1 (logged as step 0), every task.eval_every steps and after the
last step.

Determinism and resume. Every random draw is seeded from trainer.seed: sampling uses a seed
derived from (seed, "rollout", s) (and (seed, "eval", s, T, chunk)), training order is fixed, and the
global torch/python/numpy RNG states travel in the checkpoint. `fp4rl train --resume RUN_DIR`
after a crash (even kill -9) loads the newest complete checkpoint, drops the metrics.jsonl
lines of later steps and redoes them: the metrics, apart from time/* and memory/*, equal
those of an uninterrupted run. A finished run resumed with a larger trainer.steps goes on as
one run of that many steps would (given a constant LR schedule: the others span trainer.steps;
its old last step keeps the held-out eval it had as the last one); a trainer.steps below the
checkpoint's step is refused. A run with metrics but no checkpoint (trainer.checkpoint_every = 0
writes one only after the last step) is refused too: resuming it would drop them and start over.

Scale-out ([distributed], fp4rl.distributed): distributed.samplers = S splits every rollout (and
held-out evaluation) into S shards with their own derived seeds; backend "local" runs them one after
the other here, backend "ray" on S Ray actors in parallel (one Sampler each, loaded with every
payload). The numbers depend on the seed and S only: a Ray run equals the local run of the same S.

The rollout side (Rollout, held-out eval, make_batch, the async thread, the [distributed] sampler) is
fp4rl.rollout; this module holds the schedule, the stop / resume handling and `fp4rl train`.

What this loop leaves out: multiple trainers, a value model, and a KL penalty's reference beyond the
frozen initial policy (grpo.kl_coef).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from fp4rl.batch import Batch
from fp4rl.config import ConfigError, RunConfig, format_fields, load_config, save_config
from fp4rl.distributed.shards import LocalShards
from fp4rl.metrics import MetricsLogger, format_progress, plot, read_metrics
from fp4rl.rollout import (
    WORKER_CLOSE_S,
    Rollout,
    Rollouts,
    RolloutWorker,
    make_batch,
    rollout_sampler,
    rollout_version,
)
from fp4rl.run_dirs import check_fresh, check_resumable, resume_config, warn_changed_settings
from fp4rl.tasks import Task, task_from_config
from fp4rl.trainer import Trainer, latest_checkpoint


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_distributed(config: RunConfig, device: str) -> None:
    """ConfigError for a [distributed] section this run cannot use (before the model is loaded)."""
    d = config.distributed
    d.require_backend()
    if d.backend == "ray" and device == "cuda" and d.gpus_per_sampler == 0:
        raise ConfigError("distributed.backend = \"ray\" on CUDA with distributed.gpus_per_sampler = 0: "
                          "the sampler actors would have no GPU; set distributed.gpus_per_sampler = 1 (or a "
                          "fraction to share one), or model.device = \"cpu\"")
    if d.backend == "ray" and device != "cuda" and d.gpus_per_sampler > 0:
        raise ConfigError(f"distributed.gpus_per_sampler = {d.gpus_per_sampler:g} but the run samples on "
                          f"{device} (model.device = {config.model.device!r}): set "
                          "distributed.gpus_per_sampler = 0 for CPU sampler actors, or run on CUDA")


class RunInterrupted(KeyboardInterrupt):
    """train() stopped on Ctrl-C / SIGTERM at the end of a step, after writing that step's checkpoint (step 0:
    after the held-out eval before training, which a resume redoes: nothing trained, nothing to save)."""

    def __init__(self, step: int, run_dir: Path):
        done = (f"after step {step} with its checkpoint written" if step else
                "after the held-out eval before step 1 (nothing trained yet)")
        super().__init__(f"interrupted: stopped {done}; continue the run with "
                         f"`fp4rl train --resume {run_dir}`")
        self.step, self.run_dir = step, run_dir


class StopRequest:
    """Ctrl-C (SIGINT) or SIGTERM during train(): the first one asks the run to stop at the end of the step in
    progress, where a checkpoint is written (nothing trained is lost, and --resume continues exactly); a
    second one stops at once, as Ctrl-C does without this (back to the last checkpoint). Handlers are only
    installed from the main thread (signals are delivered there); elsewhere `requested` stays False."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested: str | None = None
        self._old: dict = {}

    def _handle(self, signum, frame):
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        print(f"\n{self.requested}: stopping after the step in progress, with a checkpoint (again: stop now, "
              "back to the last checkpoint)", file=sys.stderr, flush=True)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


# ---------------------------------------------------------------------------------- train


def train(config: RunConfig, *, task: Task | None = None) -> list[dict]:
    """Run (or resume) the RL job described by `config`; returns the run's metrics records."""
    from fp4rl import weight_sync
    from fp4rl.hf import load_model
    from fp4rl.precision import PrecisionContract
    from fp4rl.sampler import Sampler, default_eos_token_ids

    c = config
    run_dir = c.run_dir
    checkpoint = latest_checkpoint(run_dir, clean=True) if c.run.resume else None
    if c.run.resume:
        check_resumable(c, checkpoint)
    else:
        check_fresh(run_dir)
    seed_everything(c.trainer.seed)
    task = task or task_from_config(c.task)
    task.batch(0, c.task.prompts_per_step)  # fails now, not at step 1, if the split is too small

    device = c.device()
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device = {c.model.device!r} but torch sees no CUDA device here (torch "
                          f"{torch.__version__}): use model.device = 'auto' or 'cpu'")
    if c.logging.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("logging.wandb = true but wandb is not installed: pip install wandb (or set "
                              "logging.wandb = false)") from None
    check_distributed(c, device)
    if c.model.dtype == "bfloat16":
        warnings.warn("model.dtype = 'bfloat16': AdamW updates the bf16 master weights in place, and a "
                      "change below half a bf16 ulp of a weight rounds away (at trainer.lr = 5e-6 most "
                      "weights never move); model.dtype = 'float32' keeps them exact", stacklevel=2)
    model, tokenizer = load_model(c.model.name, dtype=getattr(torch, c.model.dtype), device=device)
    if tokenizer is None:
        raise ValueError(f"model.name = {c.model.name!r} has no tokenizer files: RL needs one for prompts")
    context = model.config.max_position_embeddings
    for key, new in (("sampler.max_new_tokens", c.sampler.max_new_tokens),
                     ("eval.max_new_tokens", c.eval.max_new_tokens)):
        if context and new and new >= context:  # now, not at the first generate after the step-0 eval
            raise ConfigError(f"{key} = {new} leaves no room for a prompt in the model's context of "
                              f"{context} tokens (max_position_embeddings of {c.model.name!r}): lower {key}")
    contract = PrecisionContract(**c.precision.contract_kwargs())
    trainer = Trainer(model, contract, c)
    if c.precision.trace:
        from fp4rl import trace

        try:
            guided = trace.guided_modules(trainer.model, c.precision.trace_deep_fraction)
        except ValueError as exc:  # routed experts quantized unalike within a layer
            raise ConfigError(str(exc)) from None
        if not guided:
            raise ConfigError(f"precision.trace = true but this model under precision.preset = "
                              f"{c.precision.preset!r} and precision.rules = {dict(c.precision.rules)} has "
                              "no W4A4 linear in the guided layers "
                              f"(trace_deep_fraction = {c.precision.trace_deep_fraction}): TRACE would guide "
                              "nothing. Use a preset or rules with W4A4 linears ('nvfp4-linear'; "
                              "'nvfp4-experts' only has them in an MoE model), or precision.trace = false")
    staleness = c.loop.max_staleness if c.loop.mode == "async" else 0

    start_step, pending = 0, {}
    if checkpoint is not None:
        state = trainer.load_checkpoint(checkpoint)
        start_step = state["step"]
        warn_changed_settings(checkpoint, c)
        pending = {step: Rollout.from_state_dict(r, task, c.task.prompts_per_step)
                   for step, r in state["extra"].get("pending_rollouts", {}).items()}
    # async: the rollouts still to make, up to k steps past the last one (a checkpoint after step s
    # stores those of s + 1 .. s + k, module docstring)
    first, last = start_step + 1 + len(pending), c.trainer.steps + staleness
    needs = rollout_version(first, staleness)
    if staleness > 0 and needs < trainer.policy_version:  # the sampler only moves on from the checkpoint's
        if first <= c.trainer.steps:
            raise ConfigError(
                f"{checkpoint} holds the rollouts of steps {sorted(pending) or 'none'}, but step {first} "
                f"trains on one of policy version {needs} (loop.max_staleness = {staleness}), older than "
                f"the checkpoint's {trainer.policy_version}: was loop.mode or loop.max_staleness changed, "
                "or trainer.steps raised past a checkpoint that lacks the rollouts after its last step "
                "(one written before final checkpoints stored them)?")
        last = first - 1  # such a checkpoint (or a changed max_staleness): its rollouts are all there is
    run_dir.mkdir(parents=True, exist_ok=True)
    print(task.describe())
    print(contract.summary(trainer.model))
    print(f"run directory {run_dir}; " + (f"resuming after step {start_step} from {checkpoint}"
                                          if checkpoint else "starting at step 1"))

    # Samplers start from a payload like every later version does (dense tensors in BF16), so
    # version 0 and a resumed version are held exactly as a synced one
    payload = weight_sync.build_payload(trainer.model, contract, trainer.policy_version,
                                         seal=False)  # sealed by to_bytes if it leaves the process
    sampler_dtype = getattr(torch, c.sampler_dtype(device))  # ('auto': the kernel sampler's bf16 on CUDA)
    # the end-of-turn ids resolved here (tokenizer, config.json, generation_config.json): Ray actors rebuild
    # the model from its config alone and would miss generation_config.json's
    sampler_kwargs = dict(kv_cache=c.sampler.kv_cache, device=device, policy_version=trainer.policy_version,
                          dtype=sampler_dtype, eos_token_ids=default_eos_token_ids(trainer.model, tokenizer),
                          **({"dense_rows": c.sampler.dense_rows} if c.sampler.dense_rows else {}))
    with contextlib.ExitStack() as stack:  # a Ray pool is shut down however train() ends
        sampler = rollout_sampler(trainer.model, tokenizer, sampler_kwargs, c, stack, contract)
        sampler.load(payload)
        rollouts = Rollouts(task, tokenizer, c)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
            else (tokenizer.eos_token_id or 0)
        worker, eval_sampler = None, sampler
        if staleness > 0 and start_step < c.trainer.steps:  # (nothing to train: no thread)
            # the thread only generates: its rollouts are scored here, in this thread (module docstring)
            worker = RolloutWorker(sampler, functools.partial(rollouts.rollout, score=False),
                                   staleness=staleness, first_step=first, last_step=last, ready=pending)
            # however train() ends, and before the pool shuts down; an interrupted run (Ctrl-C, an error)
            # does not wait out a rollout in progress for more than WORKER_CLOSE_S
            stack.callback(worker.close, WORKER_CLOSE_S)
            # held-out eval on the trainer's weights, here, sharded as the rollouts are (any backend;
            # greedy and unguided)
            # (no dense copies: a second DQ(W) set for the eval's few large calls is not worth 2 B a weight)
            eval_sampler = Sampler(trainer.model, tokenizer, **{k: v for k, v in sampler_kwargs.items()
                                                                if k != "dense_rows"})
            if c.distributed.samplers > 1:
                eval_sampler = LocalShards(eval_sampler, c.distributed.samplers)
            eval_sampler.load(payload)

        # resuming without a checkpoint starts over (run_dirs.check_resumable: metrics.jsonl holds no record)
        resume_step = (start_step if checkpoint else -1) if c.run.resume else None
        logger = MetricsLogger(run_dir, tensorboard=c.logging.tensorboard, wandb=c.logging.wandb,
                               wandb_project=c.logging.wandb_project, config=c.to_dict(),
                               resume_step=resume_step)
        # the run's config (a resume's --set included) once everything before step 1 has worked: a resume
        # that fails before (a damaged checkpoint or metrics file) leaves the run's config.toml as it was
        save_config(c, run_dir / "config.toml")
        progress = None
        if c.logging.progress:
            from tqdm import tqdm

            progress = tqdm(total=c.trainer.steps, initial=start_step, desc=c.run.name, unit="step")

        def save_step(step: int) -> None:
            extra = {}
            if worker:
                ahead = range(step + 1, min(step + staleness, last) + 1)  # past trainer.steps too
                extra["pending_rollouts"] = {s: r.state_dict() for s, r in worker.pending(ahead).items()}
            trainer.save_checkpoint(run_dir, step, extra=extra, keep=c.trainer.checkpoint_keep)

        stop = stack.enter_context(StopRequest())
        try:
            if start_step == 0 and c.eval.at_start and task.eval:
                record = {"policy_version": 0, **rollouts.evaluate(eval_sampler, 0)}
                logger.log(0, record)
                print("step 0 (before training): " + format_progress(record))
                if stop.requested:  # not a whole training step more: a resume redoes this eval
                    raise RunInterrupted(0, run_dir)
            for step in range(start_step + 1, c.trainer.steps + 1):
                step_start = time.perf_counter()
                trained_on = trainer.policy_version
                rollout = worker.get(step) if worker else rollouts.rollout(sampler, step)
                wait_s = time.perf_counter() - step_start
                rollouts.scored(rollout)
                batch, record = make_batch(rollout, c, pad_id)
                versions = [x.policy_version for x in rollout.completions]
                record.update({
                    "rollout/policy_version": min(versions),
                    "rollout/staleness_mean": trained_on - sum(versions) / len(versions),
                    "rollout/staleness_max": trained_on - min(versions),
                })
                # a step whose groups were all dropped still measures the sampler/trainer mismatch: on the
                # whole rollout (advantages 0, nothing is trained on it)
                measure = None if len(batch) else Batch.from_completions(
                    rollout.completions, torch.zeros(len(rollout.completions)), pad_id=pad_id)
                record.update(trainer.step(batch, measure=measure))
                sync_start = time.perf_counter()
                payload = weight_sync.build_payload(trainer.model, contract, trainer.policy_version,
                                                    seal=False)
                if worker:
                    worker.publish(trainer.policy_version, payload)
                else:
                    sampler.load(payload)
                record["time/sync_s"] = time.perf_counter() - sync_start
                record["sync/bytes"] = payload.nbytes
                record["policy_version"] = trainer.policy_version
                is_last = step == c.trainer.steps
                if task.eval and (is_last or (c.task.eval_every and step % c.task.eval_every == 0)):
                    if eval_sampler is not sampler:
                        eval_sampler.load(payload)
                    record.update(rollouts.evaluate(eval_sampler, step))
                if worker:
                    record["time/rollout_wait_s"] = wait_s
                record["time/step_s"] = time.perf_counter() - step_start
                logger.log(step, record)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix_str(format_progress(record))
                stopping = stop.requested is not None  # read once: a signal may arrive between two reads
                every = c.trainer.checkpoint_every
                if is_last or (every and step % every == 0) or stopping:
                    save_step(step)
                if stopping and not is_last:
                    raise RunInterrupted(step, run_dir)
        finally:
            if progress is not None:
                progress.close()
            logger.close()
    records = read_metrics(run_dir)
    try:
        plot(run_dir)
    except Exception as exc:  # the run is trained and checkpointed: its plots are not worth failing it
        warnings.warn(f"plotting {run_dir} failed ({type(exc).__name__}: {exc}); the run is complete. "
                      f"Draw them again with `fp4rl plot {run_dir}`", stacklevel=2)
    _print_summary(records)
    return records


def _print_summary(records: list[dict]) -> None:
    evals = [r for r in records if "eval/accuracy" in r]
    if len(evals) >= 2:
        first, last = evals[0], evals[-1]
        print(f"held-out greedy accuracy: {first['eval/accuracy']:.3f} (step {first['step']}) -> "
              f"{last['eval/accuracy']:.3f} (step {last['step']})")


# ---------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.toml", help="run config (defaults < file < --set)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one key, e.g. --set trainer.lr=1e-5 (repeatable)")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue RUN_DIR from its newest checkpoint, with its config.toml (+ --set)")
    parser.add_argument("--help-config", action="store_true", help="list every config key and exit")


def config_from_args(args) -> RunConfig:
    """The RunConfig that `fp4rl train` runs: --config or RUN_DIR/config.toml, then --set."""
    if args.resume is None:
        return load_config(args.config, args.overrides)
    if args.config is not None:
        raise ConfigError("--resume RUN_DIR reads RUN_DIR/config.toml; change keys with --set, not --config")
    return resume_config(Path(args.resume), args.overrides)


def run(args) -> int:
    if args.help_config:
        print(format_fields())
        return 0
    try:
        train(config_from_args(args))
    except (ConfigError, FileNotFoundError, FileExistsError) as e:  # raised before step 1
        if os.environ.get("FP4RL_TRACEBACK") == "1":
            raise
        print(f"fp4rl train: error: {e}", file=sys.stderr)
        return 2
    except RunInterrupted as e:
        print(f"fp4rl train: {e}", file=sys.stderr)
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fp4rl train", description="Run (or resume) an RL job.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""Trainer: one GRPO update of the QAT policy per rollout batch, and its checkpoints.

`Trainer(model, contract, config)` converts the model with the precision contract (the same
NVFP4 linears the sampler runs), and `step(batch)`:

1. recomputes the log-probabilities of the sampled tokens with the QAT forward, at the
   sampling temperature, as the sampler defines them: log_softmax(logits / T). MoE layers
   replay the sampler's routing (`batch.routing`), so both score the same experts.
   The decoder runs under the configured autocast (BF16); lm_head and log_softmax run in FP32,
   because BF16 logits alone would put ~0.03 nats of rounding into every logprob and drown the
   NVFP4 mismatch this project measures;
2. computes the GRPO loss of fp4rl.grpo with the importance-sampling correction of
   pi_old / mu (the trainer before this step's first update over the sampler), over
   micro-batches whose losses share one denominator (the whole batch's tokens or sequences,
   after MIS's rejections), so accumulating them gives the full-batch gradient. In a sync run
   pi_old has the weights the sampler was given, so pi_old / mu is the NVFP4 mismatch alone; in
   an async run whose batch is k steps stale it is k updates newer than the sampler's weights,
   so the weight corrects the staleness too and mismatch/* measures both (decoupled PPO: the
   clip is around pi_old, the IS weight carries the rest);
3. clips the global gradient norm, steps AdamW at the learning rate of the schedule
   (linear warmup, then constant, linear or cosine decay to 0), and bumps `policy_version`.

With `loop.updates_per_batch = k > 1` the batch is used for k optimizer updates; pi_old is
then the trainer before the first one (one extra no-grad forward). A batch with no sequences
(every group had zero advantage and was dropped) makes no update but still counts as a step:
`policy_version` is the number of steps taken, so staleness is counted in steps.

Mismatch metrics (fp4rl.grpo) are computed once over the whole batch from pi_old and mu:
mean/max |logprob diff|, the k3 KL(mu || pi_old), the TIS clip fraction and mean IS weight.

Checkpoints (`save_checkpoint`, `load_checkpoint`, `latest_checkpoint`). A checkpoint is a
directory `checkpoints/step_{step:06d}/` holding the model (HF names: config.json +
model.safetensors, loadable by fp4rl.load_model and transformers), `trainer.pt` (optimizer,
update count that drives the LR schedule, step, policy_version, the torch/python/numpy RNG
states and whatever the loop adds, e.g. in-flight rollouts) and `config.toml`. It is written
into a hidden temporary directory, every file and the directory fsynced, then renamed into
place: a directory named step_* is complete by construction, and a temporary one left by a
kill is ignored (and removed) later. The newest `keep` checkpoints are kept.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import random
import re
import resource
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from fp4rl import trace
from fp4rl.batch import Batch, check_routing
from fp4rl.config import MIN_TEMPERATURE, ConfigError, RunConfig, dump_toml
from fp4rl.grpo import grpo_loss, importance_weights, mismatch_metrics, token_logprobs
from fp4rl.hf import fsync_dir, fsync_tree, load_state_dict, save_model
from fp4rl.precision import PrecisionContract
from fp4rl.qat import convert

CHECKPOINT_DIR = "checkpoints"
_CHECKPOINT = re.compile(r"step_(\d{6,})")
_STATE_FILE = "trainer.pt"


def lr_factor(update: int, *, schedule: str, warmup: int, total: int) -> float:
    """Multiplier of the peak learning rate for optimizer update `update` (from 0) of `total`.

    Warmup: (update + 1) / warmup for the first `warmup` updates. Then, with
    p = (update - warmup) / (total - warmup) in [0, 1): constant 1, linear 1 - p,
    cosine (1 + cos(pi p)) / 2.
    """
    if update < warmup:
        return (update + 1) / warmup
    p = (update - warmup) / max(1, total - warmup)
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return max(0.0, 1.0 - p)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(p, 1.0)))
    raise ValueError(f"trainer.lr_schedule = {schedule!r}: allowed values are 'constant', 'linear', 'cosine'")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory: CUDA bytes allocated since the last reset, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


class Trainer:
    """The policy's optimizer side: `step(batch) -> metrics`, checkpoints. See the module docstring."""

    def __init__(self, model: torch.nn.Module, contract: PrecisionContract, config: RunConfig):
        tc = config.trainer
        if not config.sampler.temperature >= MIN_TEMPERATURE:
            raise ValueError(f"sampler.temperature = {config.sampler.temperature}: RL needs sampling, "
                             f"so it must be >= {MIN_TEMPERATURE} (greedy decoding is for eval.temperatures)")
        self.config, self.contract = config, contract
        self.model = convert(model, contract)
        self.device = next(self.model.parameters()).device
        self.temperature = config.sampler.temperature
        self.trace_stats = trace.TraceStats()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=tc.lr, betas=tuple(tc.betas),
                                           weight_decay=tc.weight_decay)
        self.updates_per_batch = config.loop.updates_per_batch
        self.total_updates = tc.steps * self.updates_per_batch
        if tc.warmup_steps > self.total_updates:
            warnings.warn(f"trainer.warmup_steps = {tc.warmup_steps} is more than the run's "
                          f"{self.total_updates} optimizer updates (trainer.steps = {tc.steps} x "
                          f"loop.updates_per_batch = {self.updates_per_batch}): the learning rate never "
                          f"reaches trainer.lr (it peaks at {self.total_updates / tc.warmup_steps:.3g} x "
                          "lr). Lower trainer.warmup_steps, or raise trainer.steps", stacklevel=2)
        self.autocast_dtype = torch.bfloat16 if tc.autocast == "bf16" else None
        self.policy_version = 0  # steps taken; the sampler's weights carry the same number
        self.updates = 0  # optimizer updates taken; drives the LR schedule
        self.ref_model = None
        if config.grpo.kl_coef > 0:  # a frozen copy of the initial policy
            self.ref_model = copy.deepcopy(self.model).requires_grad_(False)

    # ------------------------------------------------------------------------------ forward

    def logprobs(self, batch: Batch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """log_softmax(logits / T) of input_ids[:, 1:] -> [B, T-1] fp32 (with grad when enabled)."""
        model = model or self.model
        routing = None if batch.routing is None else list(batch.routing)  # per layer [B, T-1, top_k] int16
        guided = contextlib.nullcontext()
        # TRACE: the policy's guided linears round towards the sampler's codes. Only the policy: the
        # rollout's guidance says how the sampler's policy quantized its activations, nothing about the
        # frozen reference, whose logprobs (the KL term's anchor) must not depend on the rollout
        if batch.guidance is not None and model is self.model:
            guided = trace.guiding(model, batch.guidance, batch.guidance_valid, self.trace_stats,
                                   deep_fraction=1.0)
        with guided, torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                                    enabled=self.autocast_dtype is not None):
            hidden, _ = model.model(batch.input_ids[:, :-1], routing=routing)  # [B, T-1, H]
        head = model.lm_head
        with torch.autocast(self.device.type, enabled=False):
            if type(head) is torch.nn.Linear:  # in fp32 even over bf16 master weights
                bias = None if head.bias is None else head.bias.float()
                logits = torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)  # [B, T-1, V]
            else:  # an NVFP4 lm_head (precision.rules) computes its own way
                logits = head(hidden.float())
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return token_logprobs(logits, batch.input_ids[:, 1:])  # [B, T-1]

    # ------------------------------------------------------------------------------ step

    def step(self, batch: Batch, *, measure: Batch | None = None) -> dict[str, float]:
        """One RL step on `batch` (see the module docstring) -> train/*, mismatch/*, time/, memory/.

        An empty `batch` (every group dropped: equal rewards) updates nothing: train/loss and
        train/grad_norm are 0, and the mismatch/* metrics come from `measure` (the step's whole rollout,
        its logprobs by one no-grad forward), so every step logs them."""
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        config = self.config
        metrics: dict[str, float] = {"train/sequences": len(batch), "train/tokens": batch.num_tokens}
        self.trace_stats = trace.TraceStats()  # TRACE counters of this step's guided forwards
        batch = batch.to(self.device)
        if batch.routing is not None:  # once per step (one host sync): replay would index out of range
            check_routing(batch.routing, self.model.config.num_experts, "Batch.routing")
        micro = batch.split(config.trainer.micro_batch_size)
        if config.grpo.loss_agg == "token-mean":
            denominator = float(max(batch.num_tokens, 1))
        else:
            denominator = float(max(int((batch.loss_mask.sum(1) > 0).sum()), 1))

        self.model.train()
        old, ref = [None] * len(micro), [None] * len(micro)
        with torch.no_grad():
            if self.updates_per_batch > 1:
                old = [self.logprobs(mb) for mb in micro]
            if self.ref_model is not None:
                ref = [self.logprobs(mb, self.ref_model) for mb in micro]
        pi_old = list(old)
        sums: dict[str, float] = {}  # token-weighted sums of per-micro-batch metrics
        weight_total, losses, grad_norms, lrs, kls = 0.0, [], [], [], []
        for _ in range(self.updates_per_batch if micro else 0):
            lr = config.trainer.lr * lr_factor(self.updates, schedule=config.trainer.lr_schedule,
                                               warmup=config.trainer.warmup_steps, total=self.total_updates)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum, kl_sum, kept = 0.0, 0.0, 0.0
            for i, mb in enumerate(micro):
                logprobs = self.logprobs(mb)  # [b, t] with grad
                if pi_old[i] is None:
                    pi_old[i] = logprobs.detach()
                loss, m = grpo_loss(logprobs, mb.advantages, mb.loss_mask, config.grpo,
                                    old_logprobs=old[i], sampler_logprobs=mb.sampler_logprobs,
                                    ref_logprobs=ref[i], loss_denominator=denominator)
                loss.backward()
                loss_sum += loss.item()
                kl_sum += m.get("train/kl_ref", 0.0)  # each a part of the batch's (the batch denominator)
                kept += m["train/loss_units"]
                tokens = m["train/kept_tokens"]  # what the two metrics below average over (after MIS)
                weight_total += tokens
                for key in ("train/clip_frac", "train/ratio_mean"):
                    if key in m:
                        sums[key] = sums.get(key, 0.0) + m[key] * tokens
            if config.grpo.is_correction == "mis":
                # MIS's rejected tokens (sequences) leave the denominator too (grpo.py): the micro-batches
                # divided by the whole batch's count, known only now; the loss is linear in 1/denominator
                scale = denominator / max(kept, 1.0)
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(scale)
                loss_sum, kl_sum = loss_sum * scale, kl_sum * scale
            max_norm = config.trainer.grad_clip if config.trainer.grad_clip > 0 else math.inf
            grad_norms.append(torch.nn.utils.clip_grad_norm_(self.params, max_norm).item())
            if not (math.isfinite(loss_sum) and math.isfinite(grad_norms[-1])):
                # an optimizer step now would write NaN/Inf into the weights and the AdamW state (and from
                # there into every later rollout and checkpoint): refused before anything is changed
                self.optimizer.zero_grad(set_to_none=True)
                raise ValueError(
                    f"trainer step {self.policy_version + 1} (update {self.updates + 1}): the loss "
                    f"({loss_sum}) or the gradient norm ({grad_norms[-1]}) is not finite; this update was "
                    "not applied to the weights or the optimizer. Lower trainer.lr or set trainer.grad_clip "
                    "> 0 (a diverging run), check the rewards and advantages, then resume from the last "
                    "checkpoint (fp4rl train --resume)")
            self.optimizer.step()
            self.updates += 1
            losses.append(loss_sum)
            kls.append(kl_sum)
            lrs.append(lr)
        self.policy_version += 1

        if micro:
            metrics["train/loss"] = sum(losses) / len(losses)
            metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
            metrics["train/grad_norm_max"] = max(grad_norms)
            metrics["train/lr"] = lrs[-1]
            metrics.update({k: v / max(weight_total, 1.0) for k, v in sums.items()})
            if config.grpo.kl_coef > 0:
                metrics["train/kl_ref"] = sum(kls) / len(kls)
            metrics.update(self._mismatch(batch, micro, pi_old))
        else:  # no update: the gradient of an empty loss is zero
            metrics["train/loss"] = metrics["train/grad_norm"] = metrics["train/grad_norm_max"] = 0.0
            if measure is not None and len(measure):
                measure = measure.to(self.device)
                if measure.routing is not None:
                    check_routing(measure.routing, self.model.config.num_experts, "measure.routing")
                parts = measure.split(config.trainer.micro_batch_size)
                with torch.no_grad():
                    lps = [self.logprobs(mb) for mb in parts]
                metrics.update(self._mismatch(measure, parts, lps))
                batch = measure  # its TRACE guidance is what this step's forwards used
        if batch.guidance is not None:
            self.trace_stats.cache_bytes = sum(g.bytes_per_token(2) for g in batch.guidance.values()) * int(
                batch.guidance_valid.sum())
            self.trace_stats.tokens = int(batch.guidance_valid.sum())
            metrics.update(self.trace_stats.metrics())
        metrics["time/train_s"] = time.perf_counter() - start
        metrics["memory/peak_bytes"] = peak_memory_bytes(self.device)
        return metrics

    def _mismatch(self, batch: Batch, micro: list[Batch], pi_old: list[torch.Tensor]) -> dict[str, float]:
        """Whole-batch trainer-vs-sampler metrics from pi_old (micro-batches padded back together)."""
        trainer_lp = torch.zeros_like(batch.sampler_logprobs)  # [B, T-1]
        row = 0
        for mb, lp in zip(micro, pi_old):
            trainer_lp[row : row + len(mb), : lp.shape[1]] = lp
            row += len(mb)
        g = self.config.grpo
        out = mismatch_metrics(trainer_lp, batch.sampler_logprobs, batch.loss_mask)
        _, _, tis = importance_weights(trainer_lp, batch.sampler_logprobs, batch.loss_mask, mode="tis",
                                       level=g.is_level, tis_cap=g.tis_cap)
        out.update(tis)
        if g.is_correction == "mis":
            _, _, mis = importance_weights(trainer_lp, batch.sampler_logprobs, batch.loss_mask, mode="mis",
                                           level=g.is_level, mis_low=g.mis_low, mis_high=g.mis_high)
            out.update(mis)
        return out

    # ------------------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, run_dir: str | os.PathLike, step: int, *, extra: dict | None = None,
                        keep: int = 2) -> Path:
        """Write run_dir/checkpoints/step_{step:06d}/ atomically; keep the newest `keep`. -> its path."""
        root = Path(run_dir) / CHECKPOINT_DIR
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step_{step:06d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
        try:
            save_model(self.model, None, tmp)
            state = {
                "step": step,
                "policy_version": self.policy_version,
                "updates": self.updates,
                "optimizer": self.optimizer.state_dict(),
                "rng": rng_state(),
                "extra": extra or {},
                "precision": self.contract.resolve(self.model),  # which linears ran in which precision
            }
            torch.save(state, tmp / _STATE_FILE)
            (tmp / "config.toml").write_text(dump_toml(self.config))
            fsync_tree(tmp)
            if final.exists():  # a checkpoint of this step from an earlier attempt: replace it
                old = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=root))
                os.rename(final, old / final.name)
                shutil.rmtree(old)
            os.rename(tmp, final)
            fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for path in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
        return final

    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Restore model, optimizer, counters and RNG states from a checkpoint directory.

        Returns {"step", "policy_version", "extra"}.
        """
        path = Path(path)
        older = [p for p in list_checkpoints(path.parent.parent) if p.name < path.name]
        fix = (f"move {path} out of {path.parent} and resume again to continue from "
               + (f"{older[-1].name}, the checkpoint before it" if older else "step 1 (it is the only one)"))
        try:
            state_dict = load_state_dict(path)
        except Exception as exc:  # a missing, truncated or corrupted model.safetensors
            raise ConfigError(f"checkpoint {path}: its weights (model.safetensors) cannot be read "
                              f"({type(exc).__name__}: {exc}); the checkpoint is damaged: {fix}") from exc
        _check_shapes(self.model, state_dict, path)
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        if self.model.config.tie_word_embeddings:
            missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise ConfigError(f"checkpoint {path} does not match the model of model.name: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]} (was model.name changed?)")
        try:
            state = torch.load(path / _STATE_FILE, map_location="cpu", weights_only=False)
        except Exception as exc:
            raise ConfigError(f"checkpoint {path}: {_STATE_FILE} cannot be read ({type(exc).__name__}: "
                              f"{exc}); the checkpoint is damaged: {fix}") from exc
        if "precision" in state:  # (checkpoints from before 2026-12-01 do not record it)
            was, now = state["precision"], self.contract.resolve(self.model)
            changed = sorted(n for n in set(now) | set(was) if now.get(n) != was.get(n))
            if changed:
                n = changed[0]
                raise ConfigError(
                    f"checkpoint {path} trained {len(changed)} linear(s) in another precision than this "
                    f"config resolves to now (e.g. {n}: {was.get(n)} then, {now.get(n)} now; the contract, "
                    "or fp4rl's rule for the BF16 last layers, changed): resuming would switch them mid-run. "
                    "Restore the run's precision settings (precision.rules can pin layers), or start a new "
                    "run from the checkpoint's weights (model.name = the checkpoint directory)")
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:  # the config's hyperparameters, not the checkpoint's
            group["betas"] = tuple(self.config.trainer.betas)  # (lr is set from the schedule every update)
            group["weight_decay"] = self.config.trainer.weight_decay
        self.policy_version, self.updates = state["policy_version"], state["updates"]
        set_rng_state(state["rng"])
        return {"step": state["step"], "policy_version": state["policy_version"], "extra": state["extra"]}


# ---------------------------------------------------------------------------------- helpers


def _check_shapes(model: torch.nn.Module, state_dict: dict, path: Path) -> None:
    """ConfigError naming the first tensor whose shape differs from the model's (another model.name)."""
    own = model.state_dict()
    for key, t in state_dict.items():
        if key in own and tuple(own[key].shape) != tuple(t.shape):
            raise ConfigError(f"checkpoint {path} does not match the model of model.name: {key} is "
                              f"{list(t.shape)} there, {list(own[key].shape)} in the model (was model.name "
                              "changed?)")


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary directories are not listed)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _CHECKPOINT.fullmatch(p.name)
             and (p / _STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_CHECKPOINT.fullmatch(p.name).group(1)))


def latest_checkpoint(run_dir: str | os.PathLike, *, clean: bool = False) -> Path | None:
    """The newest complete checkpoint, or None. clean=True (only the process that runs in run_dir, e.g.
    a resume) also removes temporary directories a killed save left; a reader (export, ablate) must not:
    a live run's save in progress is one."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if clean and root.is_dir():
        for leftover in root.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        for leftover in root.glob(".old-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def rng_state() -> dict:
    """Every global RNG state a run draws from (torch CPU and CUDA, python, numpy)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])



"""The rollout side of the RL loop (fp4rl.rollout) in isolation: derived seeds and the policy version of a
step's rollout, scoring with and without partial credit, the held-out eval's seeds, the async thread's close,
and the refusal of non-finite sampler logprobs. The loop end to end: tests/test_loop.py."""

import threading
import time

import pytest
import torch

from fp4rl.config import load_config
from fp4rl.rollout import derive_seed, rollout_version


def test_derived_seeds_and_rollout_versions():
    assert derive_seed(0, "rollout", 3) == derive_seed(0, "rollout", 3) != derive_seed(0, "rollout", 4)
    assert [rollout_version(s, 0) for s in (1, 2, 3)] == [0, 1, 2]
    assert [rollout_version(s, 2) for s in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]


@pytest.mark.parametrize("partial", [True, False])
def test_partial_credit_is_a_config_key(partial):
    """task.partial_credit = false turns the task's graded score (reasoning-gym's substring credit) to 0/1."""
    from types import SimpleNamespace

    from fp4rl.rollout import Rollouts
    from fp4rl.tasks import ReasoningGymTask

    task = ReasoningGymTask("basic_arithmetic", eval_size=5, pool_size=100)
    prompt = next(p for p in task.train if p.answer.isdigit() and len(p.answer) == 1)
    config = load_config(None, [f"task.partial_credit={str(partial).lower()}"])
    completions = [SimpleNamespace(prompt_index=0, text=t) for t in (prompt.answer, f"-{prompt.answer}", "x")]
    rewards = Rollouts(task, None, config).score([prompt], completions)
    assert rewards == ([1.0, 0.5, 0.0] if partial else [1.0, 0.0, 0.0])


def test_sampled_eval_draws_a_seed_per_chunk(monkeypatch):
    """Held-out prompts go to the sampler in chunks; each chunk its own seed (with one seed, row j of every
    chunk would draw the same random numbers), each seed the same in every run."""
    from types import SimpleNamespace

    from fp4rl import rollout
    from fp4rl.tasks import ReasoningGymTask

    class Recorder:
        def __init__(self):
            self.seeds = []

        def generate(self, ids, params):
            self.seeds.append(params.seed)
            return [SimpleNamespace(prompt_index=i, sample_index=0, text="x", completion_ids=[1])
                    for i in range(len(ids))]

    monkeypatch.setattr(rollout, "EVAL_CHUNK", 2)
    task = ReasoningGymTask("basic_arithmetic", eval_size=5, pool_size=100)
    rollouts = rollout.Rollouts(task, None, load_config(None, ["eval.temperatures=[1.0]"]))
    monkeypatch.setattr(rollouts, "encode", lambda p: [1, 2])
    first, again = Recorder(), Recorder()
    rollouts.evaluate(first, 3)
    rollouts.evaluate(again, 3)
    assert len(first.seeds) == 3 and len(set(first.seeds)) == 3 and first.seeds == again.seeds


def test_closing_the_rollout_thread_does_not_wait_out_a_long_rollout():
    """An interrupted async run (Ctrl-C, an error in the trainer) leaves train() after WORKER_CLOSE_S even if
    the rollout thread is inside a long rollout; the thread stops after that rollout."""
    from types import SimpleNamespace

    from fp4rl.rollout import WORKER_CLOSE_S, RolloutWorker

    started, release = threading.Event(), threading.Event()

    def produce(sampler, step):
        started.set()
        release.wait(60)  # a rollout that takes a minute
        return step

    worker = RolloutWorker(SimpleNamespace(policy_version=0), produce, staleness=1, first_step=1, last_step=3)
    assert started.wait(10)
    t0 = time.monotonic()
    assert worker.close(0.2) is False  # still in its rollout: close returned anyway
    assert time.monotonic() - t0 < 2 and WORKER_CLOSE_S <= 10
    release.set()
    worker.thread.join(10)
    assert not worker.thread.is_alive() and worker.ready == {1: 1}  # no rollout after the stop


def test_non_finite_sampler_logprobs_are_refused_before_zero_variance_groups_are_dropped():
    """A sampler that saw NaN logits scores 0 everywhere: every group has zero variance and is dropped, so
    the loss's own check would never see the NaN; make_batch refuses the rollout first."""
    from types import SimpleNamespace

    from fp4rl.rollout import Rollout, make_batch

    config = load_config(None, [])

    def completion(i, lp):
        return SimpleNamespace(prompt_index=i // 2, sample_index=i % 2, prompt_ids=[5, 6],
                               completion_ids=[7, 8], logprobs=lp, policy_version=0, routing=None,
                               guidance=None, finish_reason="stop")

    rewards = torch.zeros(2, 2)  # every group zero-variance (dropped by default)
    ok = Rollout(1, [None, None], [completion(i, [-0.5, -1.0]) for i in range(4)], rewards, 0.0)
    make_batch(ok, config, pad_id=0)
    lps = [[-0.5, float("nan") if i == 3 else -1.0] for i in range(4)]
    bad = Rollout(1, [None, None], [completion(i, lp) for i, lp in enumerate(lps)], rewards, 0.0)
    with pytest.raises(ValueError, match=r"logprobs of completion 3 \(prompt 1, sample 1\) are NaN or Inf"):
        make_batch(bad, config, pad_id=0)

"""Tasks: prompts with ids, a held-out split, and verifiable rewards.

A `Task` holds deduplicated questions split once, seeded, into `train` and `eval` (disjoint by
question text, so held-out accuracy never measures memorised training questions), hands out
training batches deterministically by step, and scores completions with the TRL reward
signature `score(prompts, completions, **kw) -> list[float]`. A completion counts as correct
when its reward is 1.0 (partial credit, e.g. reasoning-gym's substring score, is not correct).

Sources:
- reasoning-gym datasets by name (`basic_arithmetic`, `chain_sum`, `products`, `gcd`,
  `countdown`, `gsm_symbolic`, `letter_counting`, ... any registered one), config kwargs passed
  through, scored by the dataset's own `score_answer` on the extracted answer;
- JSONL files with fields `prompt` and `answer` (optional `id`), scored by a reward function
  named "module:function" with the TRL signature (default: `math_reward`, math-verify).

Answer extraction. Small instruct models rarely answer with the bare number ("The answer is
7."), so by default a suffix "Answer with the number only." is appended to the question and the
*last number* of the completion is scored, as the dataset writes the answer when it is the same number
("3.0", "03" or "3.00" for "3": reasoning-gym's scorers compare strings and would give "3.0" a third of the
reward). Other modes: the last <answer>...</answer> tag
(reasoning-gym's convention), the last non-empty line, or the whole stripped completion.

Small question spaces. reasoning-gym's basic_arithmetic with 2 one-digit terms and + - has
only 242 distinct questions; drawing 2000 items yields many repeats. Questions are deduped by
text before the split, and a split that does not fit raises with the sizes in the message.
"""

from __future__ import annotations

import importlib
import io
import json
import math
import os
import random
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

EXTRACT_MODES = ("last_number", "answer_tag", "last_line", "full")
DEFAULT_SUFFIX = "Answer with the number only."

# a decimal number; a minus sign counts only when not glued to a word or digit ("9-4" ends in 4)
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d+(?:,\d{3})*(?:\.\d+)?|(?<![\d.])\.\d+)")  # ".5" too, not "...5"
_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def extract_answer(completion: str, mode: str = "last_number") -> str | None:
    """The part of a completion that is scored, or None when there is none."""
    if mode == "last_number":
        numbers = _NUMBER.findall(completion.replace("\u2212", "-"))  # unicode minus
        if not numbers:
            return None
        number = numbers[-1].replace(",", "")
        return number.replace(".", "0.", 1) if number.lstrip("-").startswith(".") else number  # .5 -> 0.5
    if mode == "answer_tag":
        matches = _ANSWER_TAG.findall(completion)
        return matches[-1].strip() if matches else None
    if mode == "last_line":
        lines = [line.strip() for line in completion.splitlines() if line.strip()]
        return lines[-1] if lines else None
    if mode == "full":
        return completion.strip() or None
    raise ValueError(f"extract = {mode!r}: allowed values are {EXTRACT_MODES}")


def as_written(pred: str | None, expected: str) -> str | None:
    """A number extracted in "last_number" mode, written as `expected` (the dataset's answer) when the two
    are the same number ("3.0" / "03" / "3.00" for "3", "-0" for "0"); otherwise unchanged."""
    if pred is None:
        return None
    try:
        same = Decimal(pred) == Decimal(expected.strip().replace(",", ""))
    except InvalidOperation:
        return pred
    return expected if same else pred


def _completion_text(completion) -> str:
    """A completion as text; TRL's conversational form [{"role", "content"}, ...] is accepted."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return completion[-1]["content"]
    raise TypeError(f"a completion must be a string or a list of chat messages, got {completion!r}")


@dataclass(frozen=True)
class Prompt:
    """One question: `question` is the user message as sent (suffix included)."""

    id: str
    question: str
    answer: str
    entry: dict = field(default_factory=dict, compare=False, hash=False)  # source record for scoring


# ---------------------------------------------------------------------------------- split


def split_heldout(
    prompts: Sequence[Prompt],
    eval_size: int,
    *,
    seed: int = 0,
    train_size: int | None = None,
    name: str = "task",
) -> tuple[list[Prompt], list[Prompt]]:
    """Dedupe by question text (first occurrence wins), shuffle with `seed`, split disjointly.

    Returns (train, eval): eval has eval_size questions, train the rest (or train_size of them).
    """
    distinct: dict[str, Prompt] = {}
    for p in prompts:
        distinct.setdefault(p.question, p)
    needed = eval_size + (train_size if train_size is not None else 1)
    if len(distinct) < needed:
        train_part = f"train_size={train_size}" if train_size is not None else "at least 1"
        raise ValueError(
            f"{name}: only {len(distinct)} distinct questions (from {len(prompts)} drawn), but "
            f"eval_size={eval_size} held out plus {train_part} for training needs {needed}; "
            f"lower task.eval_size, raise task.pool_size, or widen the task "
            f"(e.g. task.kwargs.max_digits)"
        )
    order = sorted(distinct.values(), key=lambda p: p.question)  # independent of draw order
    random.Random(seed).shuffle(order)
    heldout, rest = order[:eval_size], order[eval_size:]
    return (rest if train_size is None else rest[:train_size]), heldout


# ---------------------------------------------------------------------------------- tasks


class Task:
    """Train/eval prompts and a reward. Subclasses implement `score`."""

    def __init__(
        self,
        name: str,
        prompts: Sequence[Prompt],
        *,
        eval_size: int,
        seed: int = 0,
        train_size: int | None = None,
    ):
        self.name = name
        self.seed = seed
        questions: dict[str, str] = {}
        for p in prompts:  # the loop caches a prompt's tokens by id: one id, one question
            if questions.setdefault(p.id, p.question) != p.question:
                raise ValueError(f"{name}: prompt id {p.id!r} names two different questions "
                                 f"({questions[p.id]!r} and {p.question!r}); ids must be unique: fix the "
                                 "source's ids (or drop the JSONL 'id' field: each line then gets its own)")
        self.train, self.eval = split_heldout(prompts, eval_size, seed=seed, train_size=train_size, name=name)
        self.sizes = {
            "drawn": len(prompts),
            "distinct": len({p.question for p in prompts}),
            "train": len(self.train),
            "eval": len(self.eval),
        }

    def describe(self) -> str:
        s = self.sizes
        return (
            f"task {self.name}: {s['distinct']} distinct questions of {s['drawn']} drawn -> "
            f"{s['train']} train, {s['eval']} held-out eval (disjoint, seed {self.seed})"
        )

    def batch(self, step: int, size: int) -> list[Prompt]:
        """Training prompts for `step` (from 0): seeded epochs over `train`, stateless for resume."""
        if size > len(self.train):
            raise ValueError(
                f"{self.name}: task.prompts_per_step = {size} exceeds the {len(self.train)} "
                "training questions"
            )
        orders: dict[int, list[int]] = {}  # epoch -> permutation of the training questions
        out = []
        for i in range(step * size, (step + 1) * size):
            epoch, pos = divmod(i, len(self.train))
            if epoch not in orders:
                orders[epoch] = list(range(len(self.train)))
                random.Random(f"{self.seed}/{epoch}").shuffle(orders[epoch])
            out.append(self.train[orders[epoch][pos]])
        return out

    def score(self, prompts: Sequence[Prompt], completions: Sequence, **kw) -> list[float]:
        raise NotImplementedError

    def correct(self, prompts: Sequence[Prompt], completions: Sequence, **kw) -> list[bool]:
        return [r >= 1.0 for r in self.score(prompts, completions, **kw)]

    def accuracy(self, prompts: Sequence[Prompt], completions: Sequence, **kw) -> float:
        """Fraction of completions with reward 1.0."""
        flags = self.correct(prompts, completions, **kw)
        return sum(flags) / len(flags) if flags else 0.0


def _check_lengths(prompts, completions):
    if len(prompts) != len(completions):
        raise ValueError(
            f"{len(prompts)} prompts but {len(completions)} completions: pass one prompt per "
            "completion (repeat each prompt n times for a group)"
        )


def _with_suffix(question: str, suffix: str) -> str:
    if not suffix:
        return question
    return question + ("\n" if "\n" in question else " ") + suffix


class ReasoningGymTask(Task):
    """A reasoning-gym dataset, scored by its own `score_answer` on the extracted answer."""

    def __init__(
        self,
        name: str,
        kwargs: dict | None = None,
        *,
        eval_size: int = 100,
        pool_size: int = 2000,
        seed: int = 0,
        suffix: str = DEFAULT_SUFFIX,
        extract: str = "last_number",
    ):
        import reasoning_gym
        from reasoning_gym.factory import DATASETS

        if extract not in EXTRACT_MODES:
            raise ValueError(f"task.extract = {extract!r}: allowed values are {EXTRACT_MODES}")
        if name not in DATASETS:
            import difflib

            close = difflib.get_close_matches(name, list(DATASETS), n=3)
            raise ValueError(
                f"task.name = {name!r} is not a reasoning-gym dataset"
                + (f"; did you mean {', '.join(map(repr, close))}?" if close else "")
                + f" ({len(DATASETS)} available: reasoning_gym.factory.DATASETS)"
            )
        kwargs = {"seed": seed, "size": pool_size, **(kwargs or {})}
        try:
            self.dataset = reasoning_gym.create_dataset(name, **kwargs)
        except (TypeError, AssertionError, ValueError) as e:
            import dataclasses

            allowed = [f.name for f in dataclasses.fields(DATASETS[name][1])]
            raise ValueError(
                f"task.kwargs for {name} rejected ({e}); allowed keys: {', '.join(allowed)}"
            ) from e
        self.extract = extract
        if extract == "last_number":
            answers = [str(self.dataset[i]["answer"]) for i in range(len(self.dataset))]
            odd = [a for a in answers if not _NUMBER.fullmatch(a.strip())]
            if odd:
                raise ValueError(
                    f"task.extract = 'last_number' scores the last number of a completion, but {len(odd)} of "
                    f"{len(answers)} {name} answers are not plain numbers (e.g. {odd[0]!r}), which it can "
                    "never match: set task.extract = 'answer_tag' with a task.suffix that asks for "
                    "<answer>...</answer> (or 'last_line' / 'full'), not the number-only default"
                )
        prompts = [
            Prompt(
                id=f"{name}/{i}",
                question=_with_suffix(entry["question"], suffix),
                answer=str(entry["answer"]),
                entry=entry,
            )
            for i, entry in enumerate(self.dataset[i] for i in range(len(self.dataset)))
        ]
        super().__init__(name, prompts, eval_size=eval_size, seed=seed)

    def score(self, prompts, completions, **kw) -> list[float]:
        _check_lengths(prompts, completions)
        out = []
        for p, c in zip(prompts, completions):
            pred = extract_answer(_completion_text(c), self.extract)
            if self.extract == "last_number":  # the same number as the dataset writes it (module docstring)
                pred = as_written(pred, str(p.entry["answer"]))
            out.append(float(self.dataset.score_answer(pred, p.entry)))
        return out


RewardFn = Callable[..., list[float]]


def load_reward(spec: str) -> RewardFn:
    """'package.module:function' -> the function (TRL signature f(prompts, completions, **kw))."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward = {spec!r} must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward = {spec!r} cannot be loaded: {e}") from e
    if not callable(fn):
        raise ValueError(f"reward = {spec!r} is not callable")
    return fn


def _reward_name(reward) -> str:
    """How a reward is named in messages: its "module:function" spec, or the function's own name."""
    if isinstance(reward, str):
        return reward
    return f"{getattr(reward, '__module__', '?')}:{getattr(reward, '__qualname__', type(reward).__name__)}"


def _check_rewards(rewards, n: int, spec: str) -> list[float]:
    """What a reward function returned -> n finite floats, or a ValueError naming the function, the problem
    and the fix (a bad reward otherwise surfaces later as a TypeError or grpo's bare "NaN or Inf")."""
    where = f"task.kwargs.reward = {spec!r}"
    fix = (f"it must return a list of {n} finite floats, one per completion in order "
           "(e.g. 1.0 correct, 0.0 wrong)")
    try:  # a 0-d array or tensor has __iter__ but does not iterate
        if rewards is None or isinstance(rewards, (str, bytes, dict)):
            raise TypeError
        rewards = list(rewards)
    except TypeError:
        got = f"{type(rewards).__name__} {_short(rewards)}"
        raise ValueError(f"{where} returned {got}, not a list of rewards; {fix}") from None
    if len(rewards) != n:
        raise ValueError(f"{where} returned {len(rewards)} rewards for {n} completions; {fix}")
    out = []
    for i, r in enumerate(rewards):
        try:
            if r is None or isinstance(r, (str, bytes)):
                raise TypeError
            value = float(r)
        except (TypeError, ValueError):
            got = f"{type(r).__name__} ({_short(r)})"
            raise ValueError(f"{where} returned a {got} at index {i}, not a number; {fix}") from None
        if not math.isfinite(value):
            raise ValueError(f"{where} returned {value} at index {i} (the first non-finite reward); {fix}")
        out.append(value)
    return out


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class JsonlTask(Task):
    """Questions from a JSONL file ({"prompt", "answer"[, "id"]} per line) and a pluggable reward.

    Read as UTF-8 (a byte-order mark is allowed). Each non-blank line must be a JSON object whose "prompt" is
    a non-empty string and whose "answer" is a non-empty string or a number (the reward gets it as text);
    "id", when given, is a string or an integer. Anything else is refused with the file and line.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        reward: str | RewardFn = "fp4rl.tasks:math_reward",
        eval_size: int = 100,
        seed: int = 0,
        suffix: str = "",
        name: str | None = None,
    ):
        if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
            raise ValueError(f"task.kwargs.path = {path!r}: must be the JSONL file's path, a non-empty "
                             "string (e.g. task.kwargs.path = 'data/train.jsonl')")
        if not isinstance(reward, str) and not callable(reward):
            raise ValueError(f"task.kwargs.reward = {reward!r}: must be a 'package.module:function' string "
                             "(default 'fp4rl.tasks:math_reward')")
        path = Path(path)
        prompts = []
        # the built-in rewards compare with the answer; a custom one may not use it (then "" is fine)
        builtin_reward = _reward_name(reward).startswith(f"{__name__}:")
        for line_no, line in enumerate(io.StringIO(_read_utf8(path), newline=None), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not JSON ({e})") from e
            prompts.append(_jsonl_prompt(record, path, line_no, suffix, builtin_reward))
        if not prompts:
            raise ValueError(f"{path}: no questions (the file is empty or blank); write one JSON object per "
                             'line, e.g. {"prompt": "What is 2+2?", "answer": "4"}')
        self.reward_spec = _reward_name(reward)
        self.reward_fn = load_reward(reward) if isinstance(reward, str) else reward
        super().__init__(name or path.stem, prompts, eval_size=eval_size, seed=seed)

    def score(self, prompts, completions, **kw) -> list[float]:
        _check_lengths(prompts, completions)
        rewards = self.reward_fn(
            prompts=[p.question for p in prompts],
            completions=list(completions),
            answer=[p.answer for p in prompts],
            **kw,
        )
        return _check_rewards(rewards, len(prompts), self.reward_spec)


def _read_utf8(path: Path) -> str:
    """The file's text; a byte that is not UTF-8 is refused with the file and line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line_no = data[: e.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{line_no}: not UTF-8 ({e.reason}: byte {data[e.start:e.start + 1]!r} at offset "
            f"{e.start}); save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
        ) from e


def _jsonl_prompt(record, path: Path, line_no: int, suffix: str, builtin_reward: bool = True) -> Prompt:
    """One JSONL record -> a Prompt, or a ValueError naming path:line, the field and the fix."""
    where = f"{path}:{line_no}"
    example = '{"prompt": "What is 2+2?", "answer": "4"}'
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a line must be a JSON object like {example}, got "
                         f"{type(record).__name__} {_short(record)}")
    missing = {"prompt", "answer"} - set(record)
    if missing:
        raise ValueError(f"{where}: missing field(s) {sorted(missing)}")
    question, answer = record["prompt"], record["answer"]
    if answer is None and not builtin_reward:  # a reward of one's own may score without an answer
        answer = ""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f'{where}: "prompt" must be a non-empty string (the question), got '
                         f"{_short(question)}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(
            f'{where}: "answer" must be a string or a number, got {type(answer).__name__} {_short(answer)} '
            f"(the reward would compare completions with the text {str(answer)!r}); write the expected "
            'answer, e.g. "answer": "4"'
        )
    if isinstance(answer, float) and not math.isfinite(answer):
        raise ValueError(f'{where}: "answer" is {answer}, not a finite number; write the expected answer')
    if builtin_reward and not str(answer).strip():
        raise ValueError(f'{where}: "answer" is empty; no completion can match it: write the expected answer '
                         "(or score with a reward of your own that does not use it: task.kwargs.reward)")
    if "id" in record:
        pid = record["id"]
        if isinstance(pid, bool) or not isinstance(pid, (str, int)) or not str(pid).strip():
            raise ValueError(f'{where}: "id" must be a non-empty string or an integer, got {_short(pid)}; '
                             "fix it or drop the field (each line then gets its own id)")
    return Prompt(
        id=str(record.get("id", f"{path.stem}/{line_no}")),
        question=_with_suffix(question, suffix),
        answer=str(answer),
        entry=record,
    )


def load_task(
    name: str,
    kwargs: dict | None = None,
    *,
    eval_size: int = 100,
    pool_size: int = 2000,
    seed: int = 0,
    suffix: str = DEFAULT_SUFFIX,
    extract: str = "last_number",
) -> Task:
    """A task by name: 'jsonl' (kwargs: path, reward) or any reasoning-gym dataset."""
    if name == "jsonl":
        kwargs = dict(kwargs or {})
        if "path" not in kwargs:
            raise ValueError("task.name = 'jsonl' needs task.kwargs.path (and optionally task.kwargs.reward)")
        unknown = set(kwargs) - {"path", "reward"}
        if unknown:
            raise ValueError(
                f"task.kwargs for jsonl: unknown key(s) {sorted(unknown)}; allowed: path, reward"
            )
        return JsonlTask(
            kwargs["path"],
            reward=kwargs.get("reward", "fp4rl.tasks:math_reward"),
            eval_size=eval_size,
            seed=seed,
            suffix=suffix,
        )
    return ReasoningGymTask(
        name, kwargs, eval_size=eval_size, pool_size=pool_size, seed=seed, suffix=suffix, extract=extract
    )


def task_from_config(cfg) -> Task:
    """load_task from a [task] config section (fp4rl.config.TaskConfig)."""
    return load_task(
        cfg.name,
        cfg.kwargs,
        eval_size=cfg.eval_size,
        pool_size=cfg.pool_size,
        seed=cfg.seed,
        suffix=cfg.suffix,
        extract=cfg.extract,
    )


# ---------------------------------------------------------------------------------- rewards


def math_reward(prompts, completions, answer, **kw) -> list[float]:
    """1.0 where math-verify finds the completion equivalent to the answer (LaTeX, fractions...)."""
    from math_verify import parse, verify

    out = []
    for completion, gold_text in zip(completions, answer):
        gold = parse(gold_text) or parse(f"${gold_text}$")
        pred = parse(_completion_text(completion))
        out.append(1.0 if gold and pred and verify(gold, pred) else 0.0)
    return out


def number_reward(prompts, completions, answer, **kw) -> list[float]:
    """1.0 where the last number of the completion equals the numeric answer."""
    out = []
    for completion, gold in zip(completions, answer):
        pred = extract_answer(_completion_text(completion), "last_number")
        try:
            out.append(1.0 if pred is not None and float(pred) == float(str(gold).replace(",", "")) else 0.0)
        except ValueError:
            out.append(0.0)
    return out


# ---------------------------------------------------------------------------------- chat


def apply_chat_template(
    tokenizer, message: str, *, system: str = "", tokenize: bool = False, fallback: bool = True
) -> str | list[int]:
    """One user message (and optional system message) -> the generation prompt, text or ids.

    Uses the tokenizer's chat template with add_generation_prompt=True. Without a template it
    warns and uses the plain text (system, blank line, message), or raises if fallback=False.
    """
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": message}
    ]
    templated = bool(getattr(tokenizer, "chat_template", None))
    if templated:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        where = f"{type(tokenizer).__name__}({getattr(tokenizer, 'name_or_path', '')!r})"
        if not fallback:
            raise ValueError(f"{where} has no chat template; set tokenizer.chat_template or use a chat model")
        warnings.warn(
            f"{where} has no chat template: prompts are the plain message text without role markers",
            stacklevel=2,
        )
        text = f"{system}\n\n{message}" if system else message
    if not tokenize:
        return text
    # a template writes its own BOS where it wants one; plain text gets the tokenizer's default
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])

"""Run configuration: small validated dataclasses, loaded from TOML with `--set` overrides.

A run is described by one `RunConfig`, made of one dataclass per TOML table:

    [model] [precision] [sampler] [grpo] [trainer] [loop] [distributed] [task] [eval] [run] [logging]

Every field carries a one-line doc and its validation rules in `dataclasses.field(metadata=...)`
("doc", and optionally "choices", "ge", "gt", "le", "lt"); `validate_fields` (fp4rl.config_fields)
checks type and rules on construction, so a bad value fails at load time with the key and the allowed values
in the message, never halfway through a run. `describe_fields()` lists every key with its
default and doc (for `fp4rl train --help-config`).

Precedence: dataclass defaults < TOML file < `--set section.key=value` overrides. An override
value is parsed as a TOML literal (`1e-5`, `true`, `[0.9, 0.95]`, `{max_digits = 2}`) and
falls back to the raw string (`task.name=gcd`). Dotted keys reach into table-valued fields:
`task.kwargs.max_digits=2`.

`dump_toml(config)` writes the resolved config (runs/<name>/config.toml) with a tiny TOML
writer; `load_config` reads it back to an equal config.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from fp4rl.config_fields import (  # noqa: F401  (ConfigError, validate_fields: part of this module's API)
    _RULES,
    ConfigError,
    _knob,
    _Section,
    _type_name,
    validate_fields,
)
from fp4rl.grpo import GRPOConfig
from fp4rl.tasks import EXTRACT_MODES

# ---------------------------------------------------------------------------------- sections

# mirrors of fp4rl.precision's names (kept import-free here; tests check they agree)
PRECISION_PRESETS = ("bf16", "nvfp4-experts", "nvfp4-linear", "nvfp4-w4a16")
LINEAR_PRECISIONS = ("bf16", "w4a16", "w4a4")
BACKWARD_MODES = ("dequantized", "high_precision")
ERR_METRICS = ("mse", "mae")
MIN_TEMPERATURE = 1e-6  # the smallest sampling temperature (fp4rl.sampler.SamplingParams refuses less)


@dataclass
class ModelConfig(_Section):
    SECTION: ClassVar[str] = "model"
    name: str = _knob(
        "default", "Hugging Face id, local path, or 'default' (the built-in SmolLM2-135M-Instruct)"
    )
    dtype: str = _knob("float32", "dtype of the master weights; bfloat16 halves their memory, but AdamW then "
                       "updates bf16 weights in place and a change below half a bf16 ulp of a weight rounds "
                       "away (at lr 5e-6 most weights never move)", choices=("float32", "bfloat16"))
    device: str = _knob(
        "auto", "where the trainer runs ('auto': cuda if available)", choices=("auto", "cpu", "cuda")
    )


@dataclass
class PrecisionConfig(_Section):
    SECTION: ClassVar[str] = "precision"
    preset: str = _knob(
        "nvfp4-linear", "which linears run in NVFP4 (see fp4rl.precision)", choices=PRECISION_PRESETS
    )
    rules: dict = _knob(
        {}, "ordered {module glob = 'bf16' | 'w4a16' | 'w4a4'} overrides; the last match wins"
    )
    bf16_last_fraction: float = _knob(
        0.15, "fraction of the last decoder layers NVFP4 presets keep BF16 (to the nearest layer, at least "
        "one)", ge=0.0, le=1.0
    )
    weight_four_over_six: bool = _knob(
        True, "4/6 for weights: per block keep the better of max->6 and max->4"
    )
    weight_err: str = _knob("mse", "error measure of the weights' 4/6 choice", choices=ERR_METRICS)
    act_four_over_six: bool = _knob(True, "4/6 for activations (W4A4 only)")
    act_err: str = _knob("mse", "error measure of the activations' 4/6 choice", choices=ERR_METRICS)
    weight_tile: str = _knob("1x16", "weight block-scale tile", choices=("1x16", "16x16"))
    backward: str = _knob(
        "dequantized",
        "backward GEMM operands: the dequantized forward operands, or the original W and x",
        choices=BACKWARD_MODES,
    )
    trace: bool = _knob(False, "TRACE: round trainer activations towards the sampler's recorded FP4 codes "
                        "(W4A4 linears of the deep layers; fp4rl.trace)")
    trace_deep_fraction: float = _knob(
        1.0, "TRACE: the deepest fraction of the decoder layers guided (1: all; the paper's compact cache "
        "guides the deep half, 0.5: half the bytes, but the unguided layers' flips then reach the deep ones)",
        ge=0.0, le=1.0)

    def check(self):
        for glob, precision in self.rules.items():
            if precision not in LINEAR_PRECISIONS:
                raise ConfigError(
                    f"precision.rules.{glob!r} = {precision!r}: allowed values are "
                    + ", ".join(map(repr, LINEAR_PRECISIONS))
                )
        if self.trace and self.preset in ("bf16", "nvfp4-w4a16") and "w4a4" not in self.rules.values():
            raise ConfigError(f"precision.trace = true guides W4A4 linears, which precision.preset = "
                              f"{self.preset!r} has none of: use 'nvfp4-linear' (every decoder linear) or "
                              "'nvfp4-experts' (the routed experts of an MoE model), or rules")
        if self.trace and self.trace_deep_fraction == 0:
            raise ConfigError("precision.trace = true with precision.trace_deep_fraction = 0 guides no layer")
        for side in ("weight", "act"):  # (PrecisionContract refuses it too; here before any model loads)
            err = getattr(self, f"{side}_err")
            if err != "mse" and not getattr(self, f"{side}_four_over_six"):
                raise ConfigError(f"precision.{side}_err = {err!r} chooses between the 4/6 scalings, but "
                                  f"precision.{side}_four_over_six = false scales every block to 6: set "
                                  f"{side}_four_over_six = true, or drop {side}_err")

    def contract_kwargs(self) -> dict:
        """Keyword arguments of fp4rl.precision.PrecisionContract (everything but the TRACE keys)."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("trace")}
        kwargs["rules"] = tuple(self.rules.items())
        return kwargs


@dataclass
class SamplerConfig(_Section):
    SECTION: ClassVar[str] = "sampler"
    n: int = _knob(8, "completions per prompt (the GRPO group size)", ge=2)
    temperature: float = _knob(1.0, f"sampling temperature of the rollouts (>= {MIN_TEMPERATURE}: RL needs "
                               "sampling; greedy held-out accuracy is eval.temperatures' 0)",
                               ge=MIN_TEMPERATURE)
    top_p: float = _knob(1.0, "nucleus sampling mass (1: off); the recorded logprobs stay those of the full "
                         "distribution, so the IS weights do not see the truncation", gt=0.0, le=1.0)
    top_k: int = _knob(0, "sample among the k most likely tokens (0: off); logprobs as for top_p", ge=0)
    max_new_tokens: int = _knob(32, "completion length limit in tokens", ge=1)
    kv_cache: str = _knob("bf16", "KV-cache storage format of the sampler", choices=("bf16", "fp8", "nvfp4"))
    dtype: str = _knob("auto", "compute dtype of the sampler ('auto': bfloat16 when the trainer runs on "
                       "CUDA, which runs the kernel sampler (packed NVFP4 GEMMs, CUDA graphs), else the "
                       "master weights' dtype; 'model': the master weights' dtype); bfloat16 on a CPU runs "
                       "the fast AMX/oneDNN linears and fused decode kernels",
                       choices=("auto", "model", "float32", "bfloat16"))
    dense_rows: int = _knob(0, "CUDA kernel sampler: batches of at least this many rows (large decode "
                            "batches, prefill) run cuBLAS on a bfloat16 DQ(W) copy of each packed dense "
                            "linear where the GEMM tuner times it faster than the 4-bit kernels (always for "
                            "weights under 4 MiB, which it does not time) (+2 B per weight; same policy, the "
                            "BF16 engine's speed; the 4-bit kernels lose to cuBLAS from 64-128 rows on an "
                            "H200; 64 recommended there: 1.00-1.10x BF16 at batch 64-512 on Qwen3-8B, "
                            "bench/RESULTS.md); 0: off",
                            ge=0)


@dataclass
class TrainerConfig(_Section):
    SECTION: ClassVar[str] = "trainer"
    lr: float = _knob(5e-6, "AdamW peak learning rate", gt=0.0)
    betas: list[float] = _knob([0.9, 0.999], "AdamW (beta1, beta2)", ge=0.0, lt=1.0)
    weight_decay: float = _knob(0.0, "AdamW decoupled weight decay", ge=0.0)
    grad_clip: float = _knob(1.0, "clip the global gradient norm to this (0: off)", ge=0.0)
    lr_schedule: str = _knob(
        "constant", "learning-rate shape after warmup", choices=("constant", "cosine", "linear")
    )
    warmup_steps: int = _knob(0, "optimizer updates of linear warmup from 0 to lr (one per step unless "
                                 "loop.updates_per_batch > 1)", ge=0)
    micro_batch_size: int = _knob(8, "sequences per forward/backward (0: the whole batch at once)", ge=0)
    autocast: str = _knob("bf16", "autocast dtype of the training forward/backward", choices=("bf16", "none"))
    seed: int = _knob(0, "seed of sampling, training order and initialisation", ge=0)
    steps: int = _knob(33, "RL steps (one rollout batch each)", ge=1)
    checkpoint_every: int = _knob(0, "steps between checkpoints (0: final checkpoint only)", ge=0)
    checkpoint_keep: int = _knob(2, "newest checkpoints kept on disk (older ones are deleted)", ge=1)

    def check(self):
        if len(self.betas) != 2:
            raise ConfigError(f"trainer.betas = {self.betas}: expected two values [beta1, beta2]")


@dataclass
class LoopConfig(_Section):
    SECTION: ClassVar[str] = "loop"
    mode: str = _knob(
        "sync", "sync: sample then train; async: sample step v+1 while training v", choices=("sync", "async")
    )
    max_staleness: int = _knob(1, "async: policy versions the sampler may lag behind the trainer", ge=0)
    updates_per_batch: int = _knob(1, "optimizer steps on each rollout batch (1: on-policy trainer)", ge=1)


DISTRIBUTED_BACKENDS = ("local", "ray")


def _module_available(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@dataclass
class DistributedConfig(_Section):
    SECTION: ClassVar[str] = "distributed"
    backend: str = _knob(
        "local", "where rollout shards run: 'local' (one after the other in this process) or 'ray' (one Ray "
        "actor per sampler; needs pip install 'fp4rl[dist]')", choices=DISTRIBUTED_BACKENDS)
    samplers: int = _knob(1, "samplers = shards of every rollout; the completions depend on trainer.seed and "
                          "this number only, not on the backend (fp4rl.distributed.shards)", ge=1)
    gpus_per_sampler: float = _knob(0.0, "backend 'ray': GPUs of each sampler actor (fractions share one; 0: "
                                    "CPU actors)", ge=0.0)

    def check(self):
        if self.gpus_per_sampler > 1 and self.gpus_per_sampler != int(self.gpus_per_sampler):
            raise ConfigError(f"distributed.gpus_per_sampler = {self.gpus_per_sampler:g}: Ray gives an actor "
                              "a fraction of one GPU or a whole number of GPUs (e.g. 0.5, 1, 2)")
        if self.gpus_per_sampler > 0 and self.backend != "ray":
            raise ConfigError(f"distributed.gpus_per_sampler = {self.gpus_per_sampler:g} is for Ray actors: "
                              "set distributed.backend = \"ray\" (or distributed.gpus_per_sampler = 0)")

    def require_backend(self) -> None:
        """ConfigError when the backend's package is missing (checked when a run starts, not at load time:
        a run's config.toml stays readable on a machine without Ray)."""
        if self.backend == "ray" and not _module_available("ray"):
            raise ConfigError("distributed.backend = \"ray\" needs Ray, which is not installed: "
                              "pip install 'fp4rl[dist]' (or set distributed.backend = \"local\")")


@dataclass
class TaskConfig(_Section):
    SECTION: ClassVar[str] = "task"
    name: str = _knob("basic_arithmetic", "a reasoning-gym dataset name, or 'jsonl' (kwargs: path, reward)")
    kwargs: dict = _knob({}, "passed to the reasoning-gym dataset config (or path/reward for jsonl)")
    prompts_per_step: int = _knob(4, "distinct prompts per RL step (each sampled sampler.n times)", ge=1)
    eval_size: int = _knob(100, "held-out questions, disjoint from every training question", ge=0)
    eval_every: int = _knob(10, "steps between held-out evaluations (0: only before and after)", ge=0)
    suffix: str = _knob("Answer with the number only.", "appended to every question (empty: nothing)")
    system: str = _knob("", "system message for the chat template (empty: none)")
    extract: str = _knob("last_number", "which part of a completion a reasoning-gym task scores (a JSONL "
                         "task's reward function reads the whole completion)", choices=EXTRACT_MODES)
    partial_credit: bool = _knob(True, "reward the task's partial credit (reasoning-gym: len(answer) / "
                                 "len(extracted) when the extracted text contains the answer, e.g. 0.5 for "
                                 "'-3' or '13' when it is 3; with grpo.normalize_std a group whose best "
                                 "answer is such a near miss gives it the advantage a correct one would "
                                 "get); false: reward 1 for a correct answer, else 0 (accuracy counts only "
                                 "1 either way; docs/results.md: 0.69 vs 0.66 held-out, three seeds)")
    pool_size: int = _knob(2000, "questions drawn from the generator before dedupe and split", ge=1)
    seed: int = _knob(0, "seed of question generation and of the held-out split", ge=0)


@dataclass
class EvalConfig(_Section):
    SECTION: ClassVar[str] = "eval"
    temperatures: list[float] = _knob([0.0, 1.0], "one held-out accuracy per temperature (0: greedy)", ge=0.0)
    max_new_tokens: int = _knob(0, "completion length limit (0: sampler.max_new_tokens)", ge=0)
    at_start: bool = _knob(True, "evaluate the initial policy before step 1")

    def check(self):
        for t in self.temperatures:
            if 0 < t < MIN_TEMPERATURE:
                raise ConfigError(f"eval.temperatures: {t!r} is greedy in effect and far smaller ones "
                                  f"overflow logits / T: use 0 for greedy, or a temperature >= "
                                  f"{MIN_TEMPERATURE}")


@dataclass
class RunSection(_Section):
    SECTION: ClassVar[str] = "run"
    name: str = _knob("default", "run name: outputs go to <dir>/<name>/")
    dir: str = _knob("runs", "parent directory of run directories")
    resume: bool = _knob(False, "continue from the latest checkpoint in the run directory")

    def check(self):
        if not re.fullmatch(r"[A-Za-z0-9._=+-]+", self.name) or self.name in (".", ".."):
            raise ConfigError(f"run.name = {self.name!r}: use letters, digits and . _ - = + only")


@dataclass
class LoggingConfig(_Section):
    SECTION: ClassVar[str] = "logging"
    tensorboard: bool = _knob(True, "write TensorBoard scalars to <run dir>/tensorboard/")
    wandb: bool = _knob(False, "also log to Weights & Biases (needs `pip install wandb`)")
    wandb_project: str = _knob("fp4rl", "W&B project name")
    progress: bool = _knob(True, "show a tqdm progress bar with the key figures")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "precision": PrecisionConfig,
    "sampler": SamplerConfig,
    "grpo": GRPOConfig,
    "trainer": TrainerConfig,
    "loop": LoopConfig,
    "distributed": DistributedConfig,
    "task": TaskConfig,
    "eval": EvalConfig,
    "run": RunSection,
    "logging": LoggingConfig,
}


@dataclass
class RunConfig:
    """Everything a run needs; one attribute per TOML table."""

    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunSection = field(default_factory=RunSection)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self):
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(
                    f"[{name}] must be a {cls.__name__}, got {type(getattr(self, name)).__name__}"
                )
        sampler_dtype = self.sampler_dtype()
        if self.sampler.dense_rows and (self.model.device == "cpu" or sampler_dtype != "bfloat16"):
            fix = "set sampler.dense_rows = 0"
            if self.model.device == "cpu":
                why = "model.device = \"cpu\" samples on the CPU, which caches DQ(W) already"
            else:
                why = (f"the sampler computes in {sampler_dtype} (sampler.dtype = \"{self.sampler.dtype}\"), "
                       "the kernel sampler in bfloat16 only")
                fix = "set sampler.dtype = \"bfloat16\", or " + fix
            raise ConfigError(f"sampler.dense_rows = {self.sampler.dense_rows} is for the CUDA kernel "
                              f"sampler, but {why}: {fix}")

    def device(self) -> str:
        """Where the trainer runs: model.device, 'auto' resolved (cuda if torch sees one, else cpu)."""
        if self.model.device != "auto":
            return self.model.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def sampler_dtype(self, device: str | None = None) -> str:
        """The sampler's compute dtype (sampler.dtype resolved) where the trainer runs on `device` (None:
        self.device())."""
        if self.sampler.dtype != "auto":
            return self.model.dtype if self.sampler.dtype == "model" else self.sampler.dtype
        return "bfloat16" if str(device or self.device()).startswith("cuda") else self.model.dtype

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run.name

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        """Build from nested tables {section: {key: value}}; unknown keys raise ConfigError."""
        sections = {}
        for name, values in data.items():
            section_cls = _section_class(name)
            if not isinstance(values, dict):
                raise ConfigError(f"[{name}] must be a table, got {values!r}")
            for key in values:
                _field(section_cls, name, key)
            sections[name] = section_cls(**values)
        return cls(**sections)

    def to_dict(self) -> dict:
        return {
            name: {f.name: getattr(getattr(self, name), f.name) for f in fields(cls)}
            for name, cls in SECTIONS.items()
        }


def _unknown(kind: str, key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key.split(".")[-1], known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown {kind} {key!r}{hint} (known: {', '.join(known)})")


def _section_class(name: str) -> type:
    if name not in SECTIONS:
        raise _unknown("config section", name, list(SECTIONS))
    return SECTIONS[name]


def _field(section_cls: type, section: str, key: str):
    by_name = {f.name: f for f in fields(section_cls)}
    if key not in by_name:
        raise _unknown(f"key in [{section}]:", f"{section}.{key}", list(by_name))
    return by_name[key]


# ---------------------------------------------------------------------------------- loading


def _parse_literal(raw: str):
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _key_path(key: str) -> list[str]:
    """A TOML dotted key (quoted parts allowed: task.kwargs."a b") -> its parts."""
    try:
        node = tomllib.loads(f"{key} = 0")
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"override key {key!r} is not a valid dotted key, e.g. trainer.lr") from e
    parts = []
    while isinstance(node, dict):
        ((part, node),) = node.items()
        parts.append(part)
    return parts


def apply_override(data: dict, item: str) -> None:
    """Apply one 'section.key[.subkey...]=value' override to nested dict `data` in place."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. sampler.temperature=0.7")
    key, raw = (s.strip() for s in item.split("=", 1))
    if key.startswith("precision.rules.") and not key[len("precision.rules."):].startswith(('"', "'")) \
            and not re.fullmatch(r"[A-Za-z0-9_-]+", key[len("precision.rules."):]):
        # a module glob holds dots (and often *): it is one quoted key, not a path of tables
        glob = key[len("precision.rules."):]
        raise ConfigError(f"override key {key!r}: a precision rule's glob is one quoted key: "
                          f"--set 'precision.rules.\"{glob}\"={raw}' (or precision.rules={{\"{glob}\" = "
                          f"\"{raw}\"}})")
    parts = _key_path(key)
    if len(parts) < 2:
        raise ConfigError(f"override key {key!r} must be section.key, e.g. trainer.lr")
    section_cls = _section_class(parts[0])
    f = _field(section_cls, parts[0], parts[1])
    hint = typing.get_type_hints(section_cls)[f.name]
    if len(parts) > 2 and not (hint is dict or typing.get_origin(hint) is dict):
        raise ConfigError(f"{parts[0]}.{parts[1]} is not a table, so {key!r} cannot be set")
    value = _parse_literal(raw)
    if len(parts) == 2 and hint in (str, str | None) and not isinstance(value, str):
        value = raw  # run.name=2024 is the name "2024"
    if len(parts) > 2 and isinstance(value, str) and value == raw and raw in ("True", "False", "None"):
        # a table's value is kept as the string when it is not TOML; Python's spelling of a bool or None
        # would then be a (truthy) string: task.kwargs.allow_parentheses=False turned parentheses on
        fix = (f"write {raw.lower()} (TOML's spelling)" if raw != "None"
               else "leave the key out (TOML has no None)")
        raise ConfigError(f"{key} = {raw} is Python's spelling, which would be kept as the string {raw!r}: "
                          f"{fix}, or quote it ({key}='\"{raw}\"') if you mean the string")

    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {key!r}: {part!r} holds a value, not a table")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> RunConfig:
    """Defaults < TOML file at `path` < overrides ('section.key=value') -> validated RunConfig."""
    data: dict = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from e
        except UnicodeDecodeError as e:  # TOML is UTF-8; the codec's message names no file
            line = e.object[:e.start].count(b"\n") + 1
            raise ConfigError(f"{path}: not UTF-8 text (line {line}, byte {e.start}: "
                              f"{e.object[e.start:e.end]!r}, {e.reason}): a TOML file must be UTF-8; re-save "
                              "it as UTF-8 in your editor, or with `iconv -f <its encoding> -t utf-8`") from e
    for item in overrides:
        apply_override(data, item)
    return RunConfig.from_dict(data)


# ---------------------------------------------------------------------------------- writing


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_value(str(key))


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # JSON string escapes are valid TOML basic-string escapes; TOML also forbids raw DEL
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = [f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in value.items() if v is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    raise ConfigError(f"cannot write {value!r} ({type(value).__name__}) as TOML")


def dump_toml(config: RunConfig) -> str:
    """The resolved config as TOML text (None values are left out: they are the defaults)."""
    lines = ["# fp4rl run config, resolved (defaults + file + overrides)"]
    for name, values in config.to_dict().items():
        lines.append(f"\n[{name}]")
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in values.items() if v is not None]
    return "\n".join(lines) + "\n"


def save_config(config: RunConfig, path: str | Path) -> Path:
    """Write dump_toml(config) to `path` (e.g. runs/<name>/config.toml)."""
    from fp4rl.metrics import write_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, dump_toml(config))  # a kill mid-write keeps the old file (--resume reads it)


def describe_fields() -> list[dict]:
    """Every config key with type, default, allowed values and doc, in TOML order."""
    out = []
    defaults = RunConfig()
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            rules = [f"{text} {f.metadata[r]}" for r, _, text in _RULES if r in f.metadata]
            if "choices" in f.metadata:
                rules.append(" | ".join(repr(c) for c in f.metadata["choices"]))
            out.append(
                {
                    "key": f"{name}.{f.name}",
                    "type": _type_name(hints[f.name]),
                    "default": getattr(getattr(defaults, name), f.name),
                    "allowed": ", ".join(rules),
                    "doc": f.metadata.get("doc", ""),
                }
            )
    return out


def format_fields() -> str:
    """describe_fields() as aligned text, one key per line (for --help-config)."""
    rows = describe_fields()
    width = max(len(r["key"]) for r in rows)
    lines = []
    for r in rows:
        allowed = f" [{r['allowed']}]" if r["allowed"] else ""
        lines.append(f"{r['key']:<{width}}  = {_toml_value(r['default'])}{allowed}  # {r['doc']}")
    return "\n".join(lines)

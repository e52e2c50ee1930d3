"""Run config: validation, TOML loading, overrides, round trip."""

import math
import re
from pathlib import Path

import pytest
import torch

from fp4rl.config import (
    SECTIONS,
    ConfigError,
    RunConfig,
    SamplerConfig,
    TrainerConfig,
    apply_override,
    describe_fields,
    dump_toml,
    format_fields,
    load_config,
    save_config,
    tomllib,  # tomli on Python 3.10
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_defaults_are_valid_and_documented():
    cfg = RunConfig()
    assert cfg.run_dir == Path("runs/default")
    rows = describe_fields()
    keys = [r["key"] for r in rows]
    assert len(keys) == len(set(keys))
    assert {"sampler.n", "grpo.tis_cap", "trainer.lr", "task.kwargs", "precision.preset"} <= set(keys)
    assert all(r["doc"] for r in rows), [r["key"] for r in rows if not r["doc"]]
    assert {k.split(".")[0] for k in keys} == set(SECTIONS)
    text = format_fields()
    assert "precision.preset" in text and "'nvfp4-linear'" in text


def test_shipped_configs_load():
    default = load_config(CONFIGS / "default.toml")
    assert default.model.name == "default"
    assert default.precision.preset == "nvfp4-w4a16"
    assert (default.sampler.n, default.task.prompts_per_step) == (8, 4)
    assert default.sampler.temperature == 1.0 and default.sampler.max_new_tokens == 32
    assert default.trainer.lr == 1e-5
    assert default.task.name == "basic_arithmetic" and default.task.kwargs["operators"] == ["+", "-"]
    tiny = load_config(CONFIGS / "tiny.toml")
    assert tiny.run.name == "tiny" and tiny.trainer.steps <= 3 and not tiny.logging.tensorboard


def test_invalid_values_name_the_key_and_the_allowed_values(monkeypatch):
    with pytest.raises(
        ConfigError, match=r"precision.preset = 'fp4'.*'bf16', 'nvfp4-experts', 'nvfp4-linear'"
    ):
        load_config(overrides=["precision.preset=fp4"])
    with pytest.raises(ConfigError, match=r"sampler.temperature = -1.0: must be >= 1e-06"):
        load_config(overrides=["sampler.temperature=-1"])
    with pytest.raises(ConfigError, match=r"sampler.temperature = 0.0: must be >= 1e-06"):  # RL samples
        load_config(overrides=["sampler.temperature=0"])
    with pytest.raises(ConfigError, match=r"sampler.temperature = 1e-40: must be >= 1e-06"):  # overflows
        load_config(overrides=["sampler.temperature=1e-40"])
    with pytest.raises(ConfigError, match=r"eval.temperatures: 1e-40 is greedy in effect.*use 0 for greedy"):
        load_config(overrides=["eval.temperatures=[0.0, 1e-40]"])
    for item in ("trainer.lr=inf", "grpo.tis_cap=inf", "trainer.lr=nan", "eval.temperatures=[0.0, inf]"):
        with pytest.raises(ConfigError, match=r"must be a finite number"):
            load_config(overrides=[item])
    assert load_config(overrides=["grpo.clip_eps_high=inf"]).grpo.clip_eps_high == math.inf  # no upper clip
    with pytest.raises(ConfigError, match=r"sampler.n = 1: must be >= 2"):
        SamplerConfig(n=1)
    with pytest.raises(ConfigError, match=r"sampler.n = 'eight': expected int"):
        SamplerConfig(n="eight")
    with pytest.raises(ConfigError, match=r"sampler.n = 2.5: expected int"):
        load_config(overrides=["sampler.n=2.5"])
    with pytest.raises(ConfigError, match=r"trainer.betas"):
        TrainerConfig(betas=[0.9])
    with pytest.raises(ConfigError, match=r"trainer.betas\[1\]|trainer.betas = \[0.9, 1.0\]"):
        TrainerConfig(betas=[0.9, 1.0])
    with pytest.raises(ConfigError, match=r"logging.wandb = 'yes': expected bool"):
        load_config(overrides=["logging.wandb=yes"])
    with pytest.raises(ConfigError, match=r"precision.trace"):
        load_config(overrides=["precision.preset=bf16", "precision.trace=true"])
    with pytest.raises(ConfigError, match=r"precision.act_err = 'mae' chooses between the 4/6 scalings.*"
                                          r"set act_four_over_six = true"):
        load_config(overrides=["precision.act_four_over_six=false", "precision.act_err=mae"])
    assert load_config(overrides=["precision.weight_err=mae"]).precision.weight_err == "mae"
    with pytest.raises(ConfigError, match=r"run.name"):
        load_config(overrides=["run.name=../x"])
    # TRACE records its guidance on the kernel sampler too (fp4rl/gpu_trace.py): the dense copy goes with it
    assert load_config(overrides=["precision.trace=true", "sampler.dense_rows=64", "sampler.dtype=bfloat16",
                                  "model.device=cuda"]).sampler.dense_rows == 64
    with pytest.raises(ConfigError, match=r"sampler.dense_rows = 64 .*model.device = \"cpu\""):
        load_config(overrides=["model.device=cpu", "sampler.dense_rows=64"])
    with pytest.raises(ConfigError, match=r"sampler.dense_rows = -1: must be >= 0"):
        load_config(overrides=["sampler.dense_rows=-1", "sampler.dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"sampler.dense_rows = 64 .*computes in float32 \(sampler.dtype = "
                                          r"\"model\"\).*: set sampler.dtype = \"bfloat16\", or set "
                                          r"sampler.dense_rows = 0"):
        load_config(overrides=["sampler.dense_rows=64", "sampler.dtype=model", "model.device=cuda"])
    with monkeypatch.context() as m:  # 'auto' (the default) samples in the master weights' dtype on a CPU
        m.setattr(torch.cuda, "is_available", lambda: False)
        with pytest.raises(ConfigError, match=r"sampler.dense_rows = 64 .*computes in float32 "
                                              r"\(sampler.dtype = \"auto\"\)"):
            load_config(overrides=["sampler.dense_rows=64"])  # (model.dtype float32 by default)
        m.setattr(torch.cuda, "is_available", lambda: True)  # model.device 'auto' resolves to cuda
        assert load_config(overrides=["sampler.dense_rows=64"]).sampler_dtype() == "bfloat16"
    assert load_config(overrides=["sampler.dense_rows=64", "model.device=cuda"]).sampler.dense_rows == 64
    ok = load_config(overrides=["sampler.dense_rows=128", "sampler.dtype=bfloat16"])
    assert ok.sampler.dense_rows == 128


def test_unknown_keys_are_rejected_with_a_suggestion(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key in \[sampler\]: 'sampler.temprature'.*'temperature'"):
        load_config(overrides=["sampler.temprature=0.5"])
    with pytest.raises(ConfigError, match=r"unknown config section 'sampelr'.*'sampler'"):
        load_config(overrides=["sampelr.n=4"])
    path = tmp_path / "bad.toml"
    path.write_text("[trainer]\nlearning_rate = 1e-5\n")
    with pytest.raises(ConfigError, match=r"trainer.learning_rate"):
        load_config(path)
    path.write_text("[trainer\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path)
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(overrides=["trainer.lr"])
    with pytest.raises(ConfigError, match="not a table"):
        load_config(overrides=["trainer.lr.x=1"])


def test_a_config_that_is_not_utf8_is_named(tmp_path, capsys, monkeypatch):
    """A Latin-1 config raised the codec's "'utf-8' codec can't decode byte 0xe9", naming no file: the
    ConfigError names the file, the line and the fix, and `fp4rl train` prints it (status 2)."""
    from fp4rl.cli import main

    path = tmp_path / "latin1.toml"
    path.write_bytes('[trainer]\nlr = 1e-5\n[task]\nsuffix = "R\u00e9ponds."\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: not UTF-8 text (line 4") + ".*re-save it as"):
        load_config(path)
    monkeypatch.delenv("FP4RL_TRACEBACK", raising=False)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"fp4rl train: error: {path}: not UTF-8 text" in err and "Traceback" not in err


def test_overrides_parse_toml_literals_and_fall_back_to_strings():
    cfg = load_config(
        CONFIGS / "default.toml",
        overrides=[
            "trainer.lr=1e-5",
            "trainer.betas=[0.9, 0.95]",
            "task.name=gcd",
            "task.kwargs={max_value = 30}",
            "task.kwargs.min_value=2",
            "run.name=2024",
            "grpo.tis_cap=3",
            "logging.wandb=false",
            'task.suffix="Answer: 3 = 3"',
        ],
    )
    assert cfg.trainer.lr == 1e-5 and cfg.trainer.betas == [0.9, 0.95]
    assert cfg.task.name == "gcd" and cfg.task.kwargs == {"max_value": 30, "min_value": 2}
    assert cfg.run.name == "2024"
    assert cfg.grpo.tis_cap == 3.0 and isinstance(cfg.grpo.tis_cap, float)
    assert cfg.task.suffix == "Answer: 3 = 3"
    # dotted override merges into a table from the file
    cfg = load_config(CONFIGS / "default.toml", overrides=["task.kwargs.max_digits=2"])
    assert cfg.task.kwargs["max_digits"] == 2 and cfg.task.kwargs["operators"] == ["+", "-"]
    data = {}
    apply_override(data, "sampler.top_k = 5")
    assert data == {"sampler": {"top_k": 5}}
    # a table's non-TOML value stays a string, but not Python's True / False / None: "False" is truthy
    # (task.kwargs.allow_parentheses=False turned parentheses on)
    for raw, fix in (("False", "write false"), ("True", "write true"), ("None", "leave the key out")):
        with pytest.raises(ConfigError, match=f"allow_parentheses = {raw} is Python's spelling.*{fix}"):
            apply_override({}, f"task.kwargs.allow_parentheses={raw}")
    # a rule's glob has dots (and *): one quoted key, said so (it read as nested tables or an invalid key)
    for glob in ("model.layers.*", "model.layers.0.mlp.down_proj"):
        with pytest.raises(ConfigError, match=f"one quoted key: --set 'precision.rules.\"{re.escape(glob)}"):
            apply_override({}, f"precision.rules.{glob}=bf16")
    data = {}
    apply_override(data, 'precision.rules."model.layers.*"=bf16')
    apply_override(data, "precision.rules.lm_head=bf16")
    assert data == {"precision": {"rules": {"model.layers.*": "bf16", "lm_head": "bf16"}}}
    data = {}
    apply_override(data, "task.kwargs.allow_parentheses=false")
    apply_override(data, 'task.kwargs.label="False"')
    assert data == {"task": {"kwargs": {"allow_parentheses": False, "label": "False"}}}


def test_dump_toml_round_trips(tmp_path):
    cfg = load_config(
        CONFIGS / "default.toml",
        overrides=[
            'task.suffix="tab\\there \\"quoted\\" \\\\ é"',
            'task.kwargs.odd_key="x"',
            "eval.temperatures=[0, 0.7]",
            'task.kwargs."key with space"=1',
        ],
    )
    text = dump_toml(cfg)
    assert tomllib.loads(text)["trainer"]["lr"] == 1e-5
    path = save_config(cfg, tmp_path / "run" / "config.toml")
    again = load_config(path)
    assert again == cfg
    assert again.task.suffix == 'tab\there "quoted" \\ é'
    assert again.task.kwargs["key with space"] == 1
    assert again.eval.temperatures == [0.0, 0.7]


def test_defaults_are_not_shared_between_instances():
    a, b = RunConfig(), RunConfig()
    a.task.kwargs["x"] = 1
    a.trainer.betas[0] = 0.5
    assert b.task.kwargs == {} and b.trainer.betas == [0.9, 0.999]


def test_precision_section_builds_the_precision_contract():
    precision = pytest.importorskip("fp4rl.precision")
    from fp4rl import config

    assert config.PRECISION_PRESETS == precision.PRESETS
    assert config.LINEAR_PRECISIONS == precision.PRECISIONS
    assert config.BACKWARD_MODES == precision.BACKWARD_MODES
    assert config.ERR_METRICS == precision.ERR_METRICS
    cfg = load_config(
        CONFIGS / "default.toml",
        overrides=['precision.rules={"model.layers.0.*" = "bf16"}', "precision.weight_tile=16x16"],
    )
    contract = precision.PrecisionContract(**cfg.precision.contract_kwargs())
    assert contract.preset == "nvfp4-w4a16" and contract.rules == (("model.layers.0.*", "bf16"),)
    assert contract.weight_tile == (16, 16)
    with pytest.raises(ConfigError, match=r"precision.rules.'x' = 'fp4'.*'w4a4'"):
        load_config(overrides=["precision.rules.x=fp4"])


def test_the_sampler_samples_in_bf16_on_the_kernel_engine_where_the_trainer_runs_on_cuda():
    """sampler.dtype = 'auto' (the default): bfloat16 on CUDA, where Sampler then runs the kernel engine
    (packed NVFP4 GEMMs, CUDA graphs; a float32 sampler there ran plain torch), the master weights' dtype on
    a CPU (the default job's exact FP32 sampler); the explicit choices are kept."""
    c = load_config()
    assert c.sampler.dtype == "auto"
    assert c.sampler_dtype("cpu") == "float32" and c.sampler_dtype("cuda") == "bfloat16"
    assert c.sampler_dtype("cuda:1") == "bfloat16"
    assert c.sampler_dtype() == ("bfloat16" if torch.cuda.is_available() else "float32")  # model.device auto
    assert load_config(overrides=["model.device=cpu"]).sampler_dtype() == "float32"
    assert load_config(overrides=["model.device=cuda"]).sampler_dtype() == "bfloat16"
    assert load_config(overrides=["model.dtype=bfloat16"]).sampler_dtype("cpu") == "bfloat16"
    assert load_config(overrides=["sampler.dtype=model"]).sampler_dtype("cuda") == "float32"
    assert load_config(overrides=["sampler.dtype=float32"]).sampler_dtype("cuda") == "float32"
    assert load_config(overrides=["sampler.dtype=bfloat16"]).sampler_dtype("cpu") == "bfloat16"

"""fp4rl.kernels.pdl on any machine: when a GEMM launch may carry the programmatic-dependent-launch attribute
(only inside a decode step, never right after a decode-copy rebuild), the switch, and the launcher's argument
checks (before anything reaches the driver)."""

import ctypes

import pytest
import torch

from fp4rl.kernels import pdl


@pytest.fixture
def on_gpu(monkeypatch):
    """Pretend the device supports PDL (the step / hazard logic is the same everywhere)."""
    monkeypatch.setattr(pdl, "enabled", lambda device: pdl.is_enabled())
    pdl.set_enabled(True)
    pdl.set_kinds_off(())
    yield
    pdl.set_enabled(True)
    pdl.set_kinds_off(pdl.DEFAULT_OFF)
    pdl._STATE["hazard"] = False


def test_gemm_flag_only_inside_a_step_and_not_after_a_rebuild(on_gpu):
    assert not pdl.gemm_flag("cuda", "gemv")  # outside the engine step: weights may just have been written
    with pdl.step():
        assert pdl.gemm_flag("cuda", "gemv")
        with pdl.step():  # nested scopes (the capture's warm-up step inside another)
            assert pdl.gemm_flag("cuda", "gemv")
        assert pdl.gemm_flag("cuda", "gemv")
        pdl.hazard()  # a decode copy was just rebuilt on the stream
        assert not pdl.gemm_flag("cuda", "gemv")  # the next launch waits for it in full ...
        assert pdl.gemm_flag("cuda", "gemv")  # ... and only that one
    assert not pdl.gemm_flag("cuda", "gemv")
    with pytest.raises(RuntimeError, match="boom"), pdl.step():  # the scope ends on an exception too
        raise RuntimeError("boom")
    assert not pdl.gemm_flag("cuda", "gemv")


def test_weights_flag_inside_a_step_leaves_the_hazard_to_the_gemm(on_gpu):
    """The CUDA MoE router + route reads its router weight before its wait: PDL only inside a step and not
    while a decode-copy rebuild is pending, which it does not consume (the GEMM after it must see it)."""
    assert not pdl.weights_flag("cuda", "route")
    with pdl.step():
        assert pdl.weights_flag("cuda", "route")
        pdl.hazard()
        assert not pdl.weights_flag("cuda", "route") and not pdl.weights_flag("cuda", "route")
        assert not pdl.gemm_flag("cuda", "gemv")  # the hazard was left for the GEMM
        assert pdl.weights_flag("cuda", "route")
        pdl.set_kinds_off({"route"})
        assert not pdl.weights_flag("cuda", "route")
    with pytest.raises(ValueError, match="unknown launch kinds"):
        pdl.set_kinds_off({"router"})


def test_switching_off(on_gpu):
    pdl.set_enabled(False)
    assert not pdl.is_enabled()
    with pdl.step():
        assert not pdl.gemm_flag("cuda", "gemv")
        assert not pdl.triton_flag("cuda")


def test_off_on_a_cpu():
    assert not pdl.enabled("cpu") and not pdl.triton_flag("cpu")
    with pdl.step():
        assert not pdl.gemm_flag("cpu", "gemv")


def test_launch_checks_arguments_before_the_driver():
    stream = type("S", (), {"cuda_stream": 0})()
    # (ctypes structures go by value: a tensor map; a bare ctypes scalar is refused)
    for bad, err in ((1.5, TypeError), (True, TypeError), (2 ** 31, ValueError), ("x", TypeError),
                     (ctypes.c_int(3), TypeError)):
        with pytest.raises(err, match="kernel argument 1"):
            pdl.launch(object(), (1, 1, 1), (32, 1, 1), [torch.zeros(1), bad], 0, stream, pdl=False)


def test_kinds_off(on_gpu):
    try:
        pdl.set_kinds_off({"wide", "triton"})
        with pdl.step():
            assert pdl.gemm_flag("cuda", "mma") and pdl.gemm_flag("cuda", "grouped")
            assert not pdl.gemm_flag("cuda", "wide")
            assert not pdl.triton_flag("cuda")
            pdl.hazard()  # an off kind still consumes the hazard
            assert not pdl.gemm_flag("cuda", "wide")
            assert pdl.gemm_flag("cuda", "mma")
        with pytest.raises(ValueError, match="unknown launch kinds"):
            pdl.set_kinds_off({"gemm"})
    finally:
        pdl.set_kinds_off(())


def test_default_kinds(monkeypatch):
    """The dense CUDA GEMM goes without PDL from 2 rows unless asked (it cost the measured steps); the rest
    keep it."""
    from fp4rl.kernels.gemv_cuda import _pdl_kind

    monkeypatch.delenv("FP4RL_PDL_OFF", raising=False)
    assert pdl.env_kinds_off() == pdl.DEFAULT_OFF == {"mma", "wide", "attn", "gluon"}
    kinds = (_pdl_kind({"NT": 1}, 1), _pdl_kind({"NT": 1}, 2), _pdl_kind({"WGMMA": 1}, 1))
    assert kinds == ("gemv", "mma", "wide")
    monkeypatch.setenv("FP4RL_PDL_OFF", "")  # set but empty: every kind
    assert pdl.env_kinds_off() == frozenset()


def test_kinds_off_from_the_environment(monkeypatch):
    monkeypatch.setenv("FP4RL_PDL_OFF", "wide, grouped")
    assert pdl.env_kinds_off() == {"wide", "grouped"}
    monkeypatch.setenv("FP4RL_PDL_OFF", "wide,cublas")
    with pytest.raises(ValueError, match="FP4RL_PDL_OFF names unknown launch kinds \\['cublas'\\]"):
        pdl.env_kinds_off()


def test_benchmark_pdl_settings(monkeypatch):
    from fp4rl.benchmarks.sampler_gpu import pdl_setting

    monkeypatch.delenv("FP4RL_PDL_OFF", raising=False)
    assert pdl_setting("on") == (True, pdl.DEFAULT_OFF) and pdl_setting("off") == (False, frozenset())
    monkeypatch.setenv("FP4RL_PDL_OFF", "triton")  # 'on' is the process's setting, not always the default
    assert pdl_setting("on") == (True, frozenset({"triton"}))
    assert pdl_setting("all") == (True, frozenset())
    assert pdl_setting("no-wide+triton") == (True, frozenset({"wide", "triton"}))
    for bad in ("no-", "no-cublas", "maybe"):
        with pytest.raises(ValueError, match="--pdl item"):
            pdl_setting(bad)

"""fp4rl.packed.build_sampler_model: refusals at build time of what cannot run here."""

import pytest
import torch
from rl_fixtures import converted_model

from fp4rl.nvfp4 import cpu_gemm
from fp4rl.packed import build_sampler_model
from fp4rl.sampler import Sampler

CONFIG = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def test_nvfp4_gemm_is_refused_at_build_time_without_the_kernel(monkeypatch):
    """nvfp4_gemm=True on a CPU without the AMX kernel was accepted, then the first forward raised inside
    cpu_gemm.linear; it is refused when the copy is built, as prepack=True is, naming the fix."""
    monkeypatch.setattr(cpu_gemm, "available", lambda: False)
    model, _ = converted_model(CONFIG, "nvfp4-w4a16")
    kw = dict(dtype=torch.bfloat16, device="cpu", cache_dequantized=False, fuse=True)
    with pytest.raises(ValueError, match=r"nvfp4_gemm=True needs .*cpu_gemm.*pass nvfp4_gemm=False"):
        build_sampler_model(model, nvfp4_gemm=True, **kw)
    with pytest.raises(ValueError, match=r"pass nvfp4_gemm=False"):
        Sampler(model, eos_token_ids=[], dtype=torch.bfloat16, nvfp4_gemm=True)
    copy = build_sampler_model(model, nvfp4_gemm=False, **kw)  # the fix named works
    assert copy(torch.tensor([[1, 2, 3]])).isfinite().all()
    assert not Sampler(model, eos_token_ids=[], dtype=torch.bfloat16).nvfp4_gemm  # the default: off here

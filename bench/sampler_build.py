"""Seconds to build the sampler's copy (fp4rl.packed.build_sampler_model) of a Qwen3-30B-A3B-like MoE with
tiny dimensions (hidden 64, 128 experts of 32, top 8) at several depths, on the CPU: the per-module cost of
the build (what grows with the 18432 expert linears of the real model), not the bytes.

    python3 bench/sampler_build.py 4 8 16      (from the repository root; one line per depth)
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from fp4rl.model import CausalLM, ModelConfig  # noqa: E402
from fp4rl.packed import build_sampler_model  # noqa: E402
from fp4rl.precision import PrecisionContract  # noqa: E402
from fp4rl.qat import convert  # noqa: E402


def build_seconds(layers: int) -> float:
    cfg = dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=96,
               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=512, qk_norm=True, num_experts=128, num_experts_per_tok=8,
               moe_intermediate_size=32, norm_topk_prob=True)
    model = convert(CausalLM(ModelConfig(**cfg)).to(torch.bfloat16),
                    PrecisionContract("nvfp4-w4a16", bf16_last_fraction=0.0))
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        build_sampler_model(model, dtype=torch.bfloat16, device="cpu", cache_dequantized=False, fuse=False)
        best = min(best, time.perf_counter() - t)
    return best


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["4", "8", "16"]:
        n = int(arg)
        print(f"{n} layers ({n * 384} expert linears): {build_seconds(n):.2f} s", flush=True)

"""Shared models and helpers of the sampler kernel-path tests (test_gpu_decode.py, test_gpu_decode_fused.py):
tiny random models of each architecture, a kernel / plain-torch sampler pair, teacher-forced logits. Importing
it on a machine without CUDA sets TRITON_INTERPRET first, as the kernels need it at decoration time."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (decoration time)

from fp4rl.kvcache import make_kv_cache  # noqa: E402
from fp4rl.model import CausalLM, ModelConfig  # noqa: E402
from fp4rl.precision import PrecisionContract  # noqa: E402
from fp4rl.qat import convert  # noqa: E402
from fp4rl.sampler import Sampler  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
V = 128
DENSE = dict(model_type="qwen3", vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
             qk_norm=True)
WIDE = dict(DENSE, hidden_size=128, intermediate_size=256)  # every linear N % 16 == 0, K % 128 == 0: mma16
MOE = dict(DENSE, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           norm_topk_prob=True)
WIDE_MOE = dict(MOE, hidden_size=128, moe_intermediate_size=128)  # experts on the grouped mma16 kernel
PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13]]  # left padding of 3, 6 and 0 slots


def tiny(config, contract, seed=0, **contract_kw):
    """A random bfloat16 model with peaked logits, converted with the contract preset (contract_kw: its
    overrides; by default no BF16 last layers)."""
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.2)
    contract_kw = {"bf16_last_fraction": 0.0, **contract_kw}
    return convert(model.to(torch.bfloat16).eval(), PrecisionContract(contract, **contract_kw))


def _pair(config, contract, kv, **kw):
    model = tiny(config, contract)
    common = dict(kv_cache=kv, device=DEV, dtype=torch.bfloat16, eos_token_ids=kw.pop("eos", []), **kw)
    return Sampler(model, kernels=True, **common), Sampler(model, kernels=False, fuse=True, **common)


def teacher_forced_logits(sampler, forced):
    """Logits [P, steps + 1, V] of the sampler's prefill and decode steps over PROMPTS, fed the
    tokens `forced` [P, steps] instead of sampling (the generate loop without sampling)."""
    P, steps = len(PROMPTS), forced.shape[1]
    lens = [len(p) for p in PROMPTS]
    T_p = max(lens)
    ids = torch.zeros(P, T_p, dtype=torch.long)
    mask = torch.zeros(P, T_p + steps, dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, T_p - len(p):] = torch.tensor(p)
        mask[i, T_p - len(p):T_p] = 1
    ids, mask, forced = ids.to(DEV), mask.to(DEV), forced.to(DEV)
    model, engine = sampler.model, sampler.engine
    with torch.inference_mode():
        if engine is not None:
            cache = engine.new_cache(sampler.kv_cache, P, P, T_p + steps)
        else:
            cache = make_kv_cache(sampler.kv_cache, sampler.config, P, T_p + steps, dtype=torch.bfloat16,
                                  device=DEV)
        h, _ = model.model(ids, None, mask[:, :T_p], cache, None)
        out = [model.lm_head(h[:, -1]).float()]
        positions = torch.tensor(lens, device=DEV)
        for s in range(steps):
            mask[:, T_p + s] = 1
            if engine is not None:
                logits, _ = engine.decode(cache, forced[:, s], positions, mask[:, :T_p + s + 1])
            else:
                h, _ = model.model(forced[:, s, None], positions[:, None], mask[:, :T_p + s + 1], cache, None)
                logits = model.lm_head(h[:, -1])
            out.append(logits.float())
            positions = positions + 1
    return torch.stack(out, 1)

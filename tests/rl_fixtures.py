"""Tiny, hermetic pieces for RL tests: a 64-token word-level chat tokenizer, tiny random
Llama / Qwen3-MoE models saved as Hugging Face directories, a JSONL task and a learnable reward.

The reward (`digit_reward`: the fraction of completion words that are digits) has variance on
a random model, so GRPO groups carry signal and a few steps visibly move it. Subprocesses
import it as `rl_fixtures:digit_reward` with tests/ on PYTHONPATH.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
WORDS = ["system", "user", "assistant", *[str(d) for d in range(10)], *[f"w{i}" for i in range(47)]]
VOCAB = SPECIALS + WORDS  # 64 tokens
TINY_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def tiny_tokenizer():
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                      pad_token="<|endoftext|>", bos_token=None)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model(moe: bool = False, seed: int = 0):
    """A random fp4rl CausalLM: 4 layers (nvfp4-linear quantizes 0-2, keeps 3 BF16), vocab 64."""
    from fp4rl.model import CausalLM, ModelConfig

    common = dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                  tie_word_embeddings=True)
    if moe:
        config = ModelConfig(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, norm_topk_prob=True, **common)
    else:
        config = ModelConfig(model_type="llama", **common)
    torch.manual_seed(seed)
    model = CausalLM(config)
    with torch.no_grad():  # N(0, 1) tied embeddings make every logit row peak at the input token
        model.model.embed_tokens.weight.mul_(0.2)
    return model


def save_tiny_model(path, moe: bool = False, seed: int = 0) -> Path:
    from fp4rl.hf import save_model

    return save_model(tiny_model(moe, seed), tiny_tokenizer(), path)


def write_prompts(path, n: int = 40) -> Path:
    """n distinct questions 'w{a} w{b} w{c}' as JSONL (the answer is unused by digit_reward)."""
    path = Path(path)
    with open(path, "w") as fh:
        for i in range(n):
            prompt = f"w{i % 47} w{(7 * i + 3) % 47} w{(i // 47) + 1}"
            fh.write(json.dumps({"prompt": prompt, "answer": "0"}) + "\n")
    return path


def digit_reward(prompts, completions, answer, **kw) -> list[float]:
    """Fraction of the completion's words that are digits (0 for an empty completion)."""
    out = []
    for c in completions:
        words = c.split()
        out.append(sum(w.isdigit() for w in words) / len(words) if words else 0.0)
    return out


def run_overrides(model_dir, prompts_path, run_dir, name: str) -> list[str]:
    """--set overrides that point configs/tiny.toml at the tiny model and task."""
    return [
        f"model.name={json.dumps(str(model_dir))}",
        "task.name=jsonl",
        f"task.kwargs={{path = {json.dumps(str(prompts_path))}, reward = \"rl_fixtures:digit_reward\"}}",
        "task.suffix=\"\"",
        "task.extract=full",
        f"run.dir={json.dumps(str(run_dir))}",
        f"run.name={name}",
    ]


def tiny_assets(root) -> tuple[Path, Path]:
    """(model directory, prompts file) of the tiny RL job, written under `root`."""
    root = Path(root)
    return save_tiny_model(root / "model"), write_prompts(root / "prompts.jsonl")


def tiny_sets(assets, run_dir, name: str, *sets) -> list[str]:
    """run_overrides for `assets` (tiny_assets) followed by `sets`."""
    model_dir, prompts = assets
    return [*run_overrides(model_dir, prompts, run_dir, name), *sets]


def run_tiny(assets, run_dir, name: str, *sets) -> list[dict]:
    """`fp4rl train` of configs/tiny.toml on `assets` with `sets`; its metrics records."""
    from fp4rl.config import load_config
    from fp4rl.loop import train

    return train(load_config(TINY_CONFIG, tiny_sets(assets, run_dir, name, *sets)))


def converted_model(config: dict, preset: str, seed: int = 0):
    """(a random fp4rl CausalLM of `config` with peaked logits, converted with the preset, the contract)."""
    from fp4rl.model import CausalLM, ModelConfig
    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import convert

    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.2)
    contract = PrecisionContract(preset)
    return convert(model.eval(), contract), contract


def optimizer_step(model, seed: int = 1) -> None:
    """Change every parameter in place, as an optimizer step does."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def record_sampler_modes(monkeypatch) -> list:
    """Make fp4rl.sampler.Sampler record, per construction, the sorted modes of the model's NVFP4 linears
    (what `fp4rl generate` quantized); returns the list it appends to."""
    from fp4rl import sampler as sampler_module
    from fp4rl.qat import NVFP4Linear

    seen = []
    real = sampler_module.Sampler

    def recording(model, *args, **kwargs):
        seen.append(sorted({m.mode for m in model.modules() if isinstance(m, NVFP4Linear)}))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(sampler_module, "Sampler", recording)
    return seen

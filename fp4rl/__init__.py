"""fp4rl: reinforcement learning of LLMs in 4-bit NVFP4 that trains as well as BF16.

One model definition, one quantizer and one precision contract, shared by the trainer, the
sampler and the exporter. See README.md and docs/architecture.md.
"""

__version__ = "0.1.0"


def load_model(name_or_path="default", dtype=None, device="cpu"):
    """Load a Hugging Face checkpoint (or "default") -> (model, tokenizer). See fp4rl.hf."""
    from fp4rl.hf import load_model as _load_model

    return _load_model(name_or_path, dtype=dtype, device=device)

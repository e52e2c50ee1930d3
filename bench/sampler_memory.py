"""Where a CUDA sampler's GPU memory goes, stage by stage: the random trainer built on the GPU, moved to host
memory, the sampler's model copy (packed.build_sampler_model), the kernel engine (gpu_decode.DecodeEngine),
then a 4-token generate per batch (prefill, graph capture). Prints one JSON line per stage: GiB allocated now,
the peak since the previous stage, and the model copy's own tensors (parameters, buffers, fused groups).

    python bench/sampler_memory.py --shape qwen3-30b-a3b:8 --preset bf16 --batch 1,8,32
"""
import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())  # run from the repository root, as the other bench scripts
from fp4rl import packed  # noqa: E402
from fp4rl import sampler as sampler_mod  # noqa: E402
from fp4rl.benchmarks.decode_timing import timed_generate  # noqa: E402
from fp4rl.benchmarks.sampler_gpu import SHAPES, build_trainer  # noqa: E402

GIB = 2.0 ** 30


def stage(name: str, **extra) -> None:
    gc.collect()
    torch.cuda.synchronize()
    row = {"stage": name, "allocated_gib": round(torch.cuda.memory_allocated() / GIB, 3),
           "peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 3), **extra}
    torch.cuda.reset_peak_memory_stats()
    print(json.dumps(row), flush=True)


def own_bytes(model) -> float:
    """GiB of the distinct storages the model copy references (parameters, buffers, fused groups' buffers)."""
    seen = {}
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [g._weight for g in getattr(model, "fused_groups", []) if g._weight is not None]
    for t in tensors:
        s = t.untyped_storage()
        if s.device.type == "cuda":
            seen[s.data_ptr()] = s.nbytes()
    return round(sum(seen.values()) / GIB, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b:8", help="SHAPE[:LAYERS] (sampler_gpu.SHAPES)")
    ap.add_argument("--preset", default="bf16", help="a precision preset: bf16, nvfp4-w4a16, ...")
    ap.add_argument("--batch", default="1,8,32")
    args = ap.parse_args()
    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import convert

    shape, _, layers = args.shape.partition(":")
    cfg = SHAPES[shape]
    layers = int(layers or cfg["num_hidden_layers"])
    dev = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats()
    trainer = build_trainer(cfg, layers, dev)
    stage("trainer built", trainer_gib=round(sum(p.nbytes for p in trainer.parameters()) / GIB, 3))
    convert(trainer, PrecisionContract(args.preset, bf16_last_fraction=0.0))
    trainer.to("cpu")
    torch.cuda.empty_cache()
    stage("trainer in host memory")

    build, engine = packed.build_sampler_model, None

    def build_logged(*a, **k):
        model = build(*a, **k)
        stage("model copy built", own_gib=own_bytes(model))
        return model

    sampler_mod.build_sampler_model = build_logged
    s = sampler_mod.Sampler(trainer, device=dev, dtype=torch.bfloat16, eos_token_ids=[],
                            max_seq_len=128 + 16, kernels=True, cuda_graphs=True)
    engine = s.engine
    stage("engine attached", own_gib=own_bytes(s.model), engine=type(engine).__name__)
    g = torch.Generator().manual_seed(0)
    for batch in (int(b) for b in args.batch.split(",")):
        prompts = torch.randint(0, cfg["vocab_size"], (batch, 128), generator=g).tolist()
        timed_generate(s, prompts, 4)
        stage(f"generate batch {batch}", own_gib=own_bytes(s.model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

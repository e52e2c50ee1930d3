"""Write the default model (SmolLM2-135M-Instruct) upcycled to an MoE (fp4rl.upcycle: the same function at
initialisation), for runs of the experts-only recipe on real weights (bench/RESULTS.md, TRACE on the routed
experts):

    python bench/upcycle_default.py OUT_DIR [--experts 8] [--top-k 2] [--seed 0]
    fp4rl train --config configs/default.toml --set model.name=OUT_DIR --set precision.preset=nvfp4-experts
"""

import argparse

from fp4rl.hf import load_model, save_model
from fp4rl.upcycle import upcycle


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    model, tokenizer = load_model("default")
    moe = upcycle(model, num_experts=a.experts, top_k=a.top_k, seed=a.seed)
    print(save_model(moe, tokenizer, a.out_dir))


if __name__ == "__main__":
    main()

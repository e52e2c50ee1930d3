"""The 16x16 quantize's kernels compiled for sm_90 on a machine without a GPU: registers, spills and the SASS
instruction mix of the old tiles kernel (tiles.py, [R, NB, 16]) at its 16x16 configuration (16 rows x 128
columns, 8 warps) against the one-block-per-thread kernel that replaces it (blocks.py
_quantize_tile16_kernel: 8 tiles wide, 128 blocks for 4/6, 256 for rule 6, 4 warps) and the 1x16 4/6 block
kernel (_quantize_flat_kernel). Static counts (instructions in the binary, not executed ones). Run with the
Triton the device has (3.6): PYTHONPATH=/tmp/t36/site python bench/quant_tile16_sass.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import compile_sm90, summary  # noqa: E402

from fp4rl.kernels.quantize.blocks import _quantize_flat_kernel, _quantize_tile16_kernel  # noqa: E402
from fp4rl.kernels.quantize.tiles import _quantize_kernel  # noqa: E402

TYPES = dict(x_ptr="*bf16", d_ptr="*u8", s_ptr="*u8", g_ptr="*fp32", given_ptr="*fp32", flag_ptr="*i32",
             part_ptr="*i32", n_part="i32", R="i32", K="i32", nb_row="i32", n_blocks="i32", stride_x="i32",
             stride_d="i32", stride_s="i32", seed="i32")


def main() -> int:
    import triton

    print(f"Triton {triton.__version__}, sm_90, bfloat16 x, per-tensor amax, mse")
    for rule46 in (False, True):
        rule = "4/6" if rule46 else "6"
        old = dict(SCALE_SRC=0, PER_ROW=False, RULE46=rule46, MAE=False, STOCH=False, TILE16=True,
                   ALLOW_NF=False, BR=16, BC=128 if rule46 else 256, PMAX=1024)
        print(summary(compile_sm90(_quantize_kernel, TYPES, old, num_warps=8, num_stages=1),
                      f"16x16 rule {rule}, tiles kernel (before)"), flush=True)
        new = dict(SCALE_SRC=0, RULE46=rule46, MAE=False, ALLOW_NF=False, BT=1 if rule46 else 2, NBC=8,
                   PMAX=1024)
        print(summary(compile_sm90(_quantize_tile16_kernel, TYPES, new, num_warps=4, num_stages=1),
                      f"16x16 rule {rule}, tile16 kernel"), flush=True)
    flat = dict(SCALE_SRC=0, PER_ROW=False, RULE46=True, MAE=False, ALLOW_NF=False, N=128, PMAX=1024)
    print(summary(compile_sm90(_quantize_flat_kernel, TYPES, flat, num_warps=4, num_stages=1),
                  "1x16 rule 4/6, block kernel"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

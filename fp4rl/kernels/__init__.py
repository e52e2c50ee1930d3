"""Triton kernels for NVFP4 on GPUs without FP4 tensor cores (Hopper): the speed comes from bytes.

quantize/     quantize_2d: NVFP4 quantization, byte-identical to fp4rl.nvfp4.reference
              (arith, amax, tiles, blocks, gluon_blocks: one kernel family per module).
gemm.py       linear / grouped_linear (W4A16), linear_w4a4 (W4A4 emulation), gemm: checks, path choice, tuner.
gemm_kernel.py the Triton GEMM kernel itself, its launch and its split-K workspace.
dequantize.py packed NVFP4 -> dense (the reference's arithmetic), also re-exported as gemm.dequantize.
sample_head.py the GPU sampler's token choice (greedy / temperature sampling) in three kernels.
moe_route.py  the MoE decode route and combine; fused.py the decode step's fused elementwise kernels.
attention/    decode attention over an NVFP4 or FP8 KV cache (GQA, variable lengths)
              (triton_decode, gluon_decode + gluon_ptx, cache_formats).
_common.py    E2M1 unpacking (PTX byte-table lookup on the GPU) and E4M3 decoding.
"""

"""Offline shared memory of the Triton decode-attention kernel's launch settings for sm_90 (no GPU needed):
what bounds its CTAs a multiprocessor (attention._bf16_block's wave rule; the FP8 cache's grids).

The device machine runs Triton 3.6; on a CPU machine put its wheel first on the path (bench/attn_sass.py):
    PYTHONPATH=/tmp/t36/site:. python3 bench/attn_smem.py [bf16:128:3 fp8:128:3 ...]
Each KIND:BLOCK_T:STAGES (KIND bf16 or fp8; 4 warps, 32 query heads over 8 KV heads, head_dim 128) prints the
shared memory per CTA and how many of them fit a 228 KB Hopper multiprocessor. The integer arguments are
compiled as the launch specializes them (pointers and strides divisible by 16): without that hint Triton does
not pipeline the loads and reports 40 KB where the device's kernel takes 139 KB (bf16, 128 x 3; forty-eighth
session: 139264 / 37888 B for bf16 128 x 3 / 32 x 3, as the device's compiled kernels).
"""

import sys

sys.path.insert(0, ".")

SMEM_PER_SM = 233472  # H100 / H200: 228 KB a multiprocessor (1 KB of it reserved per CTA)


def shared_bytes(kind: str, block_t: int, stages: int, warps: int = 4) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fp4rl.kernels.attention import triton_decode as td

    fn = td._decode_attn_kernel
    names = fn.arg_names
    bf16 = kind == "bf16"
    kv = "*bf16" if bf16 else "*fp8e4nv"
    ptrs = {"q_ptr": "*bf16", "k_ptr": kv, "ks_ptr": kv, "kg_ptr": "*fp32", "v_ptr": kv, "vs_ptr": kv,
            "vg_ptr": "*fp32", "len_ptr": "*i32", "start_ptr": "*i32", "out_ptr": "*bf16",
            "part_ptr": "*fp32", "ml_ptr": "*fp32", "lock_ptr": "*i32", "cos_ptr": "*bf16",
            "sin_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16", "slot_ptr": "*i32"}
    const = dict(G=4, GP=16, D=128, FP4=False, NUM_SPLITS=1, BT=block_t, USE_ASM=False, INTERP=False,
                 HAS_START=True, BF16=bf16, MIN_CHUNK=256, NSP=1, PDL=False, ROPE=False, HAS_NORM=False,
                 stride_kt=128, stride_vt=128)
    sig = {n: ptrs.get(n, "constexpr" if n in const else "fp32" if n in ("sm_scale_log2", "inv_d", "eps")
                       else "i32") for n in names}
    div = [n for n in names if sig[n].startswith("*") or (n.startswith("stride_") and n not in const)]
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in const.items()},
                    {(names.index(n),): [["tt.divisibility", 16]] for n in div})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    return kernel.metadata.shared


if __name__ == "__main__":
    for item in sys.argv[1:] or ["bf16:128:3", "bf16:32:3", "fp8:128:3", "fp8:64:3", "fp8:32:3"]:
        kind, bt, st = item.split(":")
        b = shared_bytes(kind, int(bt), int(st))
        fit = SMEM_PER_SM // (b + 1024)
        print(f"{kind} {bt}-token tiles x {st} stages: {b} B a CTA, {fit} a multiprocessor")

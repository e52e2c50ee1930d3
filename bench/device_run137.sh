#!/bin/bash
# Forty-fifth session, after device_run136 and quant_strip_diag: 1) bench/quant_tile16.py with the tile kernel
# taking 2 or 4 tile pairs a warp at a time (quant.cu TILE_U: their loads issued together; cuda.TILE16_U),
# also staged through shared memory with coalesced loads (TILE_SMEM; cuda.TILE16_SMEM),
# for rule 6 (against the strip kernel, now the default) and 4/6 decided per tile (the default since
# device_run136: 0.339 ms on an H100); bytes compared with Triton's in every row. 2) The tile / strip GPU
# tests (tests/test_quant_cuda.py -k tile16; TILE_U 4, staged where it fits, in the decide46 half).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
timeout 150 python3 bench/quant_tile16.py --out $OUT/quant_tile16_u.json 2>&1 | grep -v Warn
echo "quant_tile16 at ${SECONDS}s"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_quant_cuda.py \
    tests/test_triton_quantize.py -k "tile16 or tree_order or by_program_shape" 2>&1 | tail -15
echo "tests at ${SECONDS}s"

#!/bin/bash
# Forty-sixth session, last call: the strip kernel at its new grid cap (cuda.STRIP16_CTAS_PER_SM = 32: a strip a
# warp at these shapes). 1) bench/quant_tile16.py at the defaults (16x16 4/6 mse / mae / imposed g on the strip
# kernel, rule 6, 1x16 4/6), 32768x4096 and 8192x14336, medians of 3. 2) The tile / strip GPU tests.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
cases="16x16 4/6 mse, decide46 per tile, strip kernel|16x16 4/6 mae, decide46 per tile, strip kernel|16x16 rule 6"
cases="$cases|1x16 4/6"
for shape in "32768 4096" "8192 14336"; do
  set -- $shape
  timeout 120 python3 bench/quant_tile16.py --rows $1 --cols $2 --repeats 3 --cases "$cases" \
      --out $OUT/quant_tile16_defaults_${1}x${2}.json 2>&1 | grep -v Warn | grep "CUDA" | grep -v "tile kernel"
  echo "quant_tile16 ${1}x${2} at ${SECONDS}s"
done
timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_quant_cuda.py \
    -k "tile16" 2>&1 | tail -5
echo "tests at ${SECONDS}s"

#!/bin/bash
# Twenty-sixth session: rule 4/6 decided by a bound (quant.cu FAST46, decide46) on the H200.
#   mode a: the quantize GPU tests (near ties by bisection included; FAST46 on and off), then bench/quant_cuda.py
#     on the 4/6 modes with decide46 ("cuda*") and with every block's exact errors ("exact*", the kernels before)
#     in the same process, bytes checked against the reference.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda)"
case "$1" in
a)
  timeout 240 python3 -m pytest -q -x -m "gpu or not slow" tests/test_quant_cuda.py tests/test_quant_fast46.py \
    2>&1 | tail -15
  timeout 300 python3 bench/quant_cuda.py --shapes 32768x4096,8192x14336,4096x4096,32x4096 \
    --modes "row 4/6 mse,tensor 4/6 mse,tensor 4/6 mae" \
    --variants cuda,cuda_bpt1,cuda_bpt2,cuda_bpt4,exact,exact_bpt1,exact_bpt2,exact_bpt4 --out "$OUT/quant46.json"
  ;;
b)  # the near-tie GPU test (fixed), then ncu on the row kernel, decide46 and exact at 4, 2, 1 blocks per thread
  timeout 120 python3 -m pytest -q -x -m "gpu or not slow" tests/test_quant_cuda.py -k fast46 2>&1 | tail -5
  timeout 400 ncu --clock-control none --kernel-name nvfp4_quant_rows --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
    --section InstructionStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters \
    python3 bench/quant46_ncu.py > "$OUT/ncu_quant46.txt" 2>&1
  grep -E "launched|Duration|Executed Ipc A|Issue Slots Busy|Registers Per|Achieved Occupancy|Theoretical Occ|\
Warp Cycles Per Issued|Executed Instructions  |No Eligible|Memory Throughput|Block Limit Reg" "$OUT/ncu_quant46.txt" | head -120
  ;;
c)  # the near-tie GPU test (fixed); FAST46 2 (codes in decide46's pass), 1 and 0 with register caps (MINB) swept;
    # then b's ncu
  timeout 120 python3 -m pytest -q -x -m "gpu or not slow" tests/test_quant_cuda.py -k fast46 2>&1 | tail -3
  timeout 200 python3 bench/quant_cuda.py --shapes 32768x4096,8192x14336 --modes "row 4/6 mse" \
    --variants cuda,cuda_bpt1_m5,cuda_bpt2_m4,cuda_bpt4_m3,cuda_bpt2_m2,fast1,fast1_bpt2_m4,exact,exact_bpt2,\
exact_bpt2_m4,exact_bpt4_m3 \
    --out "$OUT/quant46_minb_rows.json"
  timeout 150 python3 bench/quant_cuda.py --shapes 32768x4096,8192x14336 --modes "tensor 4/6 mse,tensor 4/6 mae" \
    --variants cuda,cuda_m5,cuda_m3,fast1,exact,exact_m5 --out "$OUT/quant46_minb_flat.json"
  timeout 200 ncu --clock-control none --kernel-name nvfp4_quant_rows --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
    --section InstructionStats --section SourceCounters python3 bench/quant46_ncu.py > "$OUT/ncu_quant46.txt" 2>&1
  grep -E "launched|Duration|Issue Slots Busy|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|\
Executed Instructions  |No Eligible" "$OUT/ncu_quant46.txt" | head -80
  ;;
d)  # the defaults chosen from c (2 blocks a thread at 64 registers for 4/6 with decide46): the quantize GPU tests,
    # then the standard table, every mode, against the kernels before (exact) and Triton in the same process
  timeout 300 python3 -m pytest -q -m "gpu or not slow" tests/test_quant_cuda.py tests/test_quant_fast46.py \
    tests/test_triton_quantize.py 2>&1 | tail -4
  timeout 280 python3 bench/quant_cuda.py --shapes 32768x4096,8192x14336,4096x4096,32x4096 \
    --variants cuda,exact,triton --out "$OUT/quant46_d.json"
  ;;
e)  # where decide46 starts to pay: decode- to prefill-sized activations, the launcher's choice (cuda) against
    # decide46 (fast2) and the exact errors (exact) at every size
  timeout 200 python3 bench/quant_cuda.py --shapes 32x4096,128x4096,256x4096,512x4096,1024x4096,2048x4096 \
    --modes "row 4/6 mse,tensor 4/6 mse" --variants cuda,fast2,exact --out "$OUT/quant46_e.json"
  ;;
*) echo "mode a, b, c, d or e"; exit 2 ;;
esac

#!/bin/bash
# Twenty-seventh session: rule 4/6's lean path (quant.cu FAST46 3, lean46) on the H200.
#   mode a: the quantize GPU tests (FAST46 3, 2, 1, 0; bfloat16 near ties and sign blocks), then bench/quant_cuda.py
#     on the 4/6 modes: the launcher's choice (cuda = FAST46 3) against FAST46 2 (the kernels before) and the
#     exact errors, in the same process, bytes checked against the reference; register caps for FAST46 3;
#     decode-sized tensors (where decide46 starts to pay); ncu on the row kernel, FAST46 3 then 2.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda)"
case "$1" in
a)
  timeout 200 python3 -m pytest -q -x -m "gpu or not slow" tests/test_quant_cuda.py tests/test_quant_fast46.py \
    2>&1 | tail -6
  timeout 200 python3 bench/quant_cuda.py --shapes 32768x4096,8192x14336,4096x4096 \
    --modes "row 4/6 mse,tensor 4/6 mse,tensor 4/6 mae" \
    --variants cuda,fast2,exact,fast3_bpt1_m5,fast3_bpt2_m3,fast3_bpt4_m3,fast3_bpt4_m2 --out "$OUT/quant74_a.json"
  timeout 120 python3 bench/quant_cuda.py --shapes 32x4096,128x4096,512x4096,1024x4096,2048x4096 \
    --modes "row 4/6 mse,tensor 4/6 mse" --variants cuda,fast3,fast2,exact --out "$OUT/quant74_small.json"
  timeout 150 ncu --clock-control none --kernel-name nvfp4_quant_rows --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section InstructionStats \
    --section ComputeWorkloadAnalysis python3 bench/quant46_ncu.py 3 2 > "$OUT/ncu_quant74.txt" 2>&1
  grep -E "launched|Duration|Issue Slots Busy|Registers Per|Warp Cycles Per Issued|Executed Instructions  |\
No Eligible|Executed Ipc A|DRAM Throughput" "$OUT/ncu_quant74.txt" | head -60
  ;;
b)  # why the FAST46 3 row kernel issues on 75% of cycles: stall reasons per issued instruction, pipe use
  timeout 200 ncu --clock-control none --kernel-name nvfp4_quant_rows --section LaunchStats --section Occupancy \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active" \
    python3 bench/quant46_ncu.py 3 > "$OUT/ncu_stall74.txt" 2>&1
  grep -vE "^\s*$|----" "$OUT/ncu_stall74.txt" | grep -E "launched|Registers|Occupancy|stalled|pipe|issue_active|Block Limit" | \
    awk '$NF != "0" && $NF != "0.00"' | head -80
  ;;
c)  # lean46 with __frcp_rn's fast path inlined (rcp_lean): the GPU tests, the 4/6 table against FAST46 2, and
    # the flat kernel's stall reasons (per-tensor scales)
  timeout 220 python3 -m pytest -q -x -m "gpu or not slow" tests/test_quant_cuda.py tests/test_quant_fast46.py \
    2>&1 | tail -3
  timeout 150 python3 bench/quant_cuda.py --shapes 32768x4096,8192x14336 \
    --modes "row 4/6 mse,tensor 4/6 mse,tensor 4/6 mae" --variants cuda,fast2,fast3_bpt2_m3 --out "$OUT/quant74_c.json"
  timeout 100 ncu --clock-control none --kernel-name nvfp4_quant_flat --section LaunchStats --section Occupancy \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,gpu__time_duration.sum" \
    python3 bench/quant46_ncu.py 3 flat > "$OUT/ncu_flat74.txt" 2>&1
  grep -vE "^\s*$|----" "$OUT/ncu_flat74.txt" | grep -E "launched|Registers|Achieved Occ|stalled|pipe|issue_active|inst_exec|duration" | \
    awk '$NF != "0" && $NF != "0.00"' | head -40
  ;;
d)  # lean46 with the signs by packed compares (signs8): the quantize GPU tests, then the standard table, every
    # mode, against FAST46 2 (the kernels before this session), the exact errors and Triton, in the same process
  timeout 220 python3 -m pytest -q -m "gpu or not slow" tests/test_quant_cuda.py tests/test_quant_fast46.py \
    2>&1 | tail -3
  timeout 300 python3 bench/quant_cuda.py --shapes 32768x4096,8192x14336,4096x4096,32x4096 \
    --variants cuda,fast2,exact,triton --out "$OUT/quant74_d.json"
  ;;
e)  # lean46's row kernel reading each block twice (RELOAD46: 8 or 4 blocks a thread, one block's registers):
    # its GPU tests, then the row table against the default (2 blocks a thread held in registers) and FAST46 2
  timeout 200 python3 -m pytest -q -x -m "gpu or not slow" tests/test_quant_cuda.py \
    -k "(matches_reference and 4/6) or near_ties or nonfinite or register_caps" 2>&1 | tail -3
  timeout 200 python3 bench/quant_cuda.py --shapes 32768x4096,8192x14336,4096x4096,1024x4096 --modes "row 4/6 mse" \
    --variants cuda,reload_bpt8,reload_bpt8_m3,reload_bpt8_m5,reload_bpt4,reload_bpt16,fast2 --out "$OUT/quant74_e.json"
  ;;
f)  # the defaults (RELOAD from 2 x 4 x the thread slots): the quantize GPU tests, then the 4/6 rows of the
    # standard table against lean46 with the blocks in registers (fast3), FAST46 2 and the exact errors; the
    # flat kernel with PREFETCH (_pf; rule 6 at 64 registers: _m4_pf; PREFETCH was removed after this call:
    # measured mixed, bench/RESULTS.md)
  timeout 70 python3 -m pytest -q -m "gpu or not slow" tests/test_quant_cuda.py -k "matches_reference and 3r" \
    2>&1 | tail -3
  timeout 100 python3 bench/quant_cuda.py --shapes 32768x4096,8192x14336 \
    --modes "row 4/6 mse,tensor 4/6 mse,tensor 6" \
    --variants cuda,cuda_pf,cuda_m4_pf,fast2 --out "$OUT/quant74_f.json"
  ;;
*) echo "mode a to f"; exit 2 ;;
esac

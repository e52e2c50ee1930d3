#!/bin/bash
# Twentieth session. Mode a: the review additions of the nineteenth session on the GPU (W4A4 and per-row scales
# through the WIDE candidate, the untuned 257-512-row path); the tuner timing graph chains over rotated weights
# (test, then the standard GEMM table at 32-512 rows and Qwen3-8B at batch 32-128, against the nineteenth
# session's gemm65d / sampler65e).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "${1:-a}" in
a)
  timeout 150 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -k "wide_matches or decode_copy or tuner_keeps" \
    tests/test_triton_gemm.py > $OUT/tests66a.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests66a.log | tail -12
  timeout 240 python3 -m fp4rl.benchmarks.gpu_kernels --sections gemm --rows 32,64,128,256,512 \
    --shapes 4096x14336,14336x4096,4096x6144,6144x4096,4096x4096,24576x4096,4096x12288 \
    --out $OUT/gemm66a.json > $OUT/gemm66a.log 2>&1
  echo "gemm exit $?"; grep '^|' $OUT/gemm66a.log | cut -c1-200 | tail -45
  timeout 180 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 32,64,128 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' \
    --out $OUT/sampler66a_8b.json > $OUT/sampler66a_8b.log 2>&1
  echo "8b exit $?"; grep '^|\|rror' $OUT/sampler66a_8b.log | cut -c1-250 | tail -8
  ;;
b)  # m64n256 (MG 32, one CTA per SM, weights unpacked once per 256 rows of x) against MG 16 at 256-512 rows;
    # the 128-row split / MG on the N = 4096 weights (the wgmma build at 0.6-0.7x cuBLAS there)
  timeout 270 python3 bench/mma16_sweep.py --rows 256,512 \
    --variants wide,wide+mg32+nt1,wide+mg32+nt1+s1,wide+mg32+nt1+s2,wide+mg32+nt1+d3,wide+mg32+nt1+s1+d3 \
    --shapes 14336x4096,4096x14336,24576x4096,4096x4096,6144x4096 --out $OUT/sweep66b.json > $OUT/sweep66b.log 2>&1
  echo "sweep exit $?"; grep -v '^\[' $OUT/sweep66b.log | cut -c1-150 | tail -70
  timeout 200 python3 bench/mma16_sweep.py --rows 128 \
    --variants wide,wide+s1,wide+s2,wide+s4,wide+s8,wide+mg8,wide+mg8+s2,wide+mg8+s4,wide+mg8+s8,wide+d3 \
    --shapes 4096x14336,4096x6144,4096x4096,6144x4096 --out $OUT/sweep66b128.json > $OUT/sweep66b128.log 2>&1
  echo "sweep128 exit $?"; grep -v '^\[' $OUT/sweep66b128.log | cut -c1-150 | tail -50
  ;;
c)  # row blocks and split at 64-512 rows, NT 1 (mode b: at 128 rows two 64-row blocks with split 2 beat one 128-row
    # block with split 4-8 by 17-27% on the N = 4096 weights): the map for choose_wide's rule
  V=wide; for mg in 4 8 16; do for s in 1 2 4; do V=$V,wide+nt1+mg$mg+s$s; done; done
  timeout 400 python3 bench/mma16_sweep.py --rows 64,128,256,512 --variants $V \
    --shapes 4096x4096,4096x6144,6144x4096,4096x14336,4096x12288,14336x4096,24576x4096 \
    --out $OUT/sweep66c.json > $OUT/sweep66c.log 2>&1
  echo "sweep exit $?"; grep -c FAILED $OUT/sweep66c.log; grep '^\[' $OUT/sweep66c.log | tail -2
  ;;
d)  # choose_wide's 65-128-row rule (two row blocks, split 2): GPU tests (band and row-block invariance), the
    # GEMM table at 64-256 rows, Qwen3-8B at batch 32-128 untuned, and tuned (the tuner's graph-chain timing)
  timeout 200 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py tests/test_triton_gemm.py -k "wide or choose or tuner" \
    > $OUT/tests66d.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests66d.log | tail -8
  timeout 150 python3 -m fp4rl.benchmarks.gpu_kernels --sections gemm --rows 64,128,256 \
    --shapes 4096x14336,14336x4096,4096x6144,6144x4096,4096x4096,24576x4096,4096x12288 \
    --out $OUT/gemm66d.json > $OUT/gemm66d.log 2>&1
  echo "gemm exit $?"; grep '^|' $OUT/gemm66d.log | cut -c1-200 | tail -25
  timeout 150 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 32,64,128 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' \
    --out $OUT/sampler66d_8b.json > $OUT/sampler66d_8b.log 2>&1
  echo "8b exit $?"; grep '^|\|rror' $OUT/sampler66d_8b.log | cut -c1-250 | tail -8
  timeout 150 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets nvfp4-w4a16 --tune \
    --w4a16-last 0 --batch 64,128 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' \
    --out $OUT/sampler66d_8b_tuned.json > $OUT/sampler66d_8b_tuned.log 2>&1
  echo "8b tuned exit $?"; grep '^|\|rror' $OUT/sampler66d_8b_tuned.log | cut -c1-250 | tail -5
  ;;
e)  # the session's last call: the GPU tests of the GEMM dispatch, the tuner, the decode step and the Triton GEMMs
  timeout 420 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py tests/test_triton_gemm.py tests/test_gpu_decode.py \
    > $OUT/tests66e.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests66e.log | tail -12
  ;;
f)  # (run at commit 2b06060, then reverted: no gain) the flat quantize kernel from the tensor's end (L2 reuse), the
    # quantize table with the from-start order in the same run; the wgmma GEMM at 256-512 rows without x staging (t1)
    # and without the unpack / multiplies (t2): what bounds it there
  timeout 200 python3 -m pytest -q -m gpu tests/test_quant_cuda.py > $OUT/tests66f.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests66f.log | tail -8
  timeout 150 python3 -m fp4rl.benchmarks.gpu_kernels --sections quantize --out $OUT/quant66f.json > $OUT/quant66f.log 2>&1
  echo "quant exit $?"; grep '^|\|copy' $OUT/quant66f.log | cut -c1-200 | tail -14
  timeout 100 python3 bench/mma16_sweep.py --rows 128,256,512 --variants wide,wide+t1,wide+t2 \
    --shapes 14336x4096,4096x14336,24576x4096 --out $OUT/sweep66f.json > $OUT/sweep66f.log 2>&1
  echo "sweep exit $?"; grep -v '^\[' $OUT/sweep66f.log | cut -c1-110 | tail -30
  ;;
g)  # ASH (the weights' A unpacked into shared memory, 8 shared-memory wgmma per step): GPU bit test against the
    # register-A build; timing at 64-512 rows against the committed build
  timeout 150 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -k "a_in_shared" > $OUT/tests66g.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests66g.log | tail -8
  timeout 200 python3 bench/mma16_sweep.py --rows 64,128,256,512 \
    --variants wide,wide+nt1+ash1+d3,wide+nt1+ash1+d3+s1,wide+nt1+ash1+d3+s2,wide+nt1+ash1+mg8+d4,wide+nt1+ash1+mg8+d3,wide+nt1+ash1+mg12+d4 \
    --shapes 14336x4096,4096x14336,24576x4096,4096x4096,6144x4096 --out $OUT/sweep66g.json > $OUT/sweep66g.log 2>&1
  echo "sweep exit $?"; grep -c FAILED $OUT/sweep66g.log; grep FAILED $OUT/sweep66g.log | head -3 | cut -c1-300
  ;;
h)  # ASH with the first weight steps in a group of their own (call g read weight step 0 before it landed):
    # the bit test; the sweep again (correct data)
  timeout 150 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -k "a_in_shared" > $OUT/tests66h.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests66h.log | tail -8
  timeout 150 python3 bench/mma16_sweep.py --rows 128,256,512 \
    --variants wide,wide+nt1+ash1+d3,wide+nt1+ash1+d3+s1,wide+nt1+ash1+d3+s2 \
    --shapes 14336x4096,4096x14336,24576x4096,4096x4096 --out $OUT/sweep66h.json > $OUT/sweep66h.log 2>&1
  echo "sweep exit $?"; grep -c FAILED $OUT/sweep66h.log
  python3 -c "
import json,os
d=json.load(open(os.environ['OUT']+'/sweep66h.json'))
for r in d['rows']: print(r['n'],r['k'],r['rows'],round(r['us'],1),round(r['bf16_us'],1),'%.1e'%r['rel_err'],r['variant'])"
  ;;
i)  # the last call: the tuner (operand copies by copy.copy) and the wgmma builds with the final code
  timeout 200 python3 -m pytest -q -m gpu tests/test_triton_gemm.py tests/test_gemv_cuda.py \
    -k "tuner or wide_matches or a_in_shared or decode_copy" > $OUT/tests66i.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests66i.log | tail -8
  ;;
j)  # the tuner's disk cache (fp4rl/kernels/tune_cache.py) on the GPU, and the tuner tests again
  timeout 150 python3 -m pytest -q -m gpu tests/test_triton_gemm.py -k "tuner" -x > $OUT/tests66j.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests66j.log | tail -8
  ;;
esac

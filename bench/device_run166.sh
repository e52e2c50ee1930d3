#!/bin/bash
# Fifty-first session, when device calls are scarce: on an H200, the 30B at full depth (device_run149); on an
# H100, the FP8 one-CTA rule's sampler A/B (device_run165, its first ~300 s) and then the unreached GPU tests
# (device_run163) for the rest of the call. Up to ~590 s.
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $name"
SECONDS=0
case "$name" in
  *H200*) END=${END:-575} bash bench/device_run149.sh ;;
  *) END=${END:-300} bash bench/device_run165.sh; T_T=$((585 - SECONDS)) bash bench/device_run163.sh ;;
esac

#!/bin/bash
# Fifty-first session, first call: a plain call may land on either card. On an H200, the 30B at full depth
# (device_run149, owed since the forty-first session); on an H100, the GPU tests device_run162 did not reach
# (device_run163). Up to ~590 s.
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $name"
case "$name" in
  *H200*) END=${END:-575} bash bench/device_run149.sh ;;
  *) bash bench/device_run163.sh ;;
esac

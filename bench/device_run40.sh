#!/bin/bash
# Ninth session: the weight stream's layout and ring depth alone (bench/stream_pattern.py).
export PYTHONUNBUFFERED=1
timeout 150 python3 bench/stream_pattern.py 2>&1 | tail -8

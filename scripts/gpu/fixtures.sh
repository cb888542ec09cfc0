#!/usr/bin/env bash
# Build the gpu-preset fixtures on the device (the builder itself switches cuDNN's SDPA
# off: its backward fails under torch 2.14 there with CUDNN_STATUS_BAD_PARAM).
#   scripts/gpu/fixtures.sh OUTDIR [EXTRA ARGS, e.g. --sliding-window 128]
set -euo pipefail
python3 -m vllm_draft_offload.bench fixtures --out "$1" --preset gpu --seed 0 "${@:2}"

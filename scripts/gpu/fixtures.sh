#!/usr/bin/env bash
# Build the gpu-preset fixtures on the device (the builder itself switches cuDNN's SDPA
# off: its backward fails under torch 2.14 there with CUDNN_STATUS_BAD_PARAM).
#   scripts/gpu/fixtures.sh OUTDIR [--only NAMES] [--sliding-window W]
# Default: all of them. `--only target` builds the Llama family alone (what the
# benchmarks use); `--only glm-mtp,glm-mtp2,dsv3-mla-mtp` the MTP fixtures.
# `--sliding-window 512` makes the Llama family Gemma-3-shaped (into its own OUTDIR).
set -euo pipefail
python3 -m vllm_draft_offload.bench fixtures --out "$1" --preset gpu --seed 0 "${@:2}"

#!/usr/bin/env bash
# Build the gpu-preset fixtures on the device (the builder itself switches cuDNN's SDPA
# off: its backward fails under torch 2.14 there with CUDNN_STATUS_BAD_PARAM).
#   scripts/gpu/fixtures.sh OUTDIR [--only NAMES] [--sliding-window W]
# Default: all of them. `--only target` builds the Llama family alone (what the
# benchmarks use); `--only glm-mtp,glm-mtp2,dsv3-mla-mtp` the MTP fixtures.
# `--sliding-window 512` makes the Llama family Gemma-3-shaped (into its own OUTDIR).
# `--only eagle3,glm-mtp --long-context 32768` (into its own OUTDIR, e.g. /root/fx-long):
# a final 32k-token stage so they copy from anywhere in 32k contexts (docs/fixtures.md).
set -euo pipefail
python3 -m vllm_draft_offload.bench fixtures --out "$1" --preset gpu --seed 0 "${@:2}"

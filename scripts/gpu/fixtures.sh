#!/usr/bin/env bash
# Build the gpu-preset fixtures on the device (cuDNN SDPA is off: its backward
# fails under torch 2.14 there with CUDNN_STATUS_BAD_PARAM).
#   scripts/gpu/fixtures.sh OUTDIR
set -euo pipefail
python3 - "$1" <<'PY'
import runpy
import sys

import torch

torch.backends.cuda.enable_cudnn_sdp(False)
sys.argv = ["make_fixtures.py", "--out", sys.argv[1], "--preset", "gpu", "--seed", "0"]
runpy.run_path("scripts/make_fixtures.py", run_name="__main__")
PY

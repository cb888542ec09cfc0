#!/usr/bin/env bash
# The hybrid-mtp fixture's GPU runs (Qwen3-Next-shaped: Gated-DeltaNet state in vLLM's
# mamba_cache_mode "align", a random MTP layer; docs/fixtures.md "Hybrid fixture").
#   scripts/gpu/hybrid.sh [FIXTURES [RESULTS]]   (default /root/fx-hybrid /root/acc-hybrid)
# Builds the fixture (gpu preset) unless FIXTURES/hybrid-mtp exists, then, one engine at
# a time, with vLLM's default prefix_cache_retention_interval (0: only the prompt's
# checkpoint state is kept) into RESULTS/r0 and with None (a state at every block
# boundary) into RESULTS/rnone:
#   hit   no connector, --prefix-cache-hit: vLLM's own Mamba prefix cache vs fresh (control)
#   none  no connector, default plan: the restored phase recomputes (baseline)
#   ours  DraftOffloadConnector, default plan: restored outputs must equal fresh
# --block-size is the fixture's recorded block size (vLLM keeps it: a Gated-DeltaNet
# state fits one attention page) and the connector's chunk_size is that block, so the
# prompt's checkpoint (a block boundary) is a chunk end.
set -uo pipefail
F=${1:-/root/fx-hybrid}; R=${2:-/root/acc-hybrid}
HERE=$(dirname "$0")
if [ ! -f "$F/hybrid-mtp/fixture_meta.json" ]; then
  bash "$HERE/fixtures.sh" "$F" --only hybrid-mtp || exit 1
fi
B=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["block_size"])' \
  "$F/hybrid-mtp/fixture_meta.json") || exit 1
echo "block_size=$B"
# NAME is DRAFTER-CONNECTOR, as `vllm-draft-offload table` reads it
runs=(hybrid-mtp-hit:mtp:hybrid-mtp:hit hybrid-mtp-none:mtp:hybrid-mtp:none
  hybrid-mtp-ours:mtp:hybrid-mtp:ours)
export JOBS=1 OURS_EXTRA=",\"chunk_size\":$B"
# gdn_prefill_backend triton: vLLM's default on Hopper is FlashInfer's GDN prefill,
# which imports NVIDIA's CUTLASS DSL (`cutlass`), not in the GPU bundle (H100, session
# 14: every engine died with "No module named 'cutlass'"); vLLM's own Triton kernel
# computes the same state.
GDN='"gdn_prefill_backend":"triton"'
ACCEPT_ARGS="--block-size $B --llm-kwargs {$GDN}" bash "$HERE/accept_runs.sh" "$F" "$R/r0" "${runs[@]}"
# ACCEPT_ARGS is word-split by accept_runs.sh: the JSON holds no spaces
ACCEPT_ARGS="--block-size $B --llm-kwargs {\"prefix_cache_retention_interval\":null,$GDN}" \
  bash "$HERE/accept_runs.sh" "$F" "$R/rnone" "${runs[@]}"
echo hybrid-done

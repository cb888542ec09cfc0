#!/usr/bin/env bash
# Acceptance-parity runs on the device.
#   [JOBS=N] scripts/gpu/accept_runs.sh FIXTURES OUTDIR NAME:METHOD:DRAFT:CONNECTOR ...
# CONNECTOR is ours | native | lmcache | none | corrupt (the KV-sensitivity probe) |
# corrupt_window (the probe on the target's sliding-window KV: sliding-window fixtures) |
# diverge (ours, with the divergent-successor plan: EAGLE/MTP drafters) |
# hit (no connector: the prompts again from the GPU prefix cache, vs fresh) |
# ours_l3 (ours with its fs:// storage tier, --restart-from-storage: one engine runs the
# prompts fresh and writes them to storage, a second engine process reads them back;
# two engines per run, each with ACCEPT_TIMEOUT; storage in a temp dir, removed after).
# METHOD mtp: DRAFT is the MTP fixture (it is the model); k is the fixture's own.
# ACCEPT_ARGS: more `accept` flags for every run, e.g. "--prompt-tokens 32000" (the gpu fixtures hold 32768 positions).
# OURS_EXTRA: more kv_connector_extra_config fields for ours/diverge/ours_l3, as a JSON
# fragment with a leading comma, e.g. ',"chunk_size":128' (hybrid-mtp: its block size).
# JOBS>1 runs that many engines side by side on one GPU.  Each then gets a fixed
# KV-cache size (kv_cache_memory_bytes), because vLLM's memory profiling fails when
# another process allocates or frees GPU memory while it measures.  Acceptance
# counts do not depend on timing, so this is for acceptance runs only, never speed.
set -uo pipefail
# On a bare machine FlashInfer JIT-builds its sampler for minutes at engine start.
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
F=$1; OUT=$2; shift 2
JOBS=${JOBS:-1}
mkdir -p "$OUT"
CPU=${ACCEPT_CPU_BYTES:-2000000000}
declare -A KV=(
  [ours]='{"kv_connector":"DraftOffloadConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":'$CPU${OURS_EXTRA:-}'}}'
  [native]='{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":'$CPU'}}'
  [lmcache]='{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'
  [none]='none'
)
llm_kwargs=()
if [ "$JOBS" -gt 1 ]; then
  llm_kwargs=(--llm-kwargs '{"kv_cache_memory_bytes":4000000000,"gpu_memory_utilization":0.08}')
fi

one_run() {
  local name=$1 method=$2 draft=$3 connector=$4 start extra rc
  case "$connector" in
    corrupt) extra=(--corrupt-draft-kv) ;;
    corrupt_window) extra=(--corrupt-target-window-kv) ;;
    diverge) extra=(--kv-transfer-config "${KV[ours]}" --divergent-successors) ;;
    hit) extra=(--prefix-cache-hit) ;;
    ours_l3) extra=(--kv-transfer-config "${KV[ours]}" --restart-from-storage) ;;
    *) extra=(--kv-transfer-config "${KV[$connector]}") ;;
  esac
  start=$(date +%s)
  python3 -m vllm_draft_offload.bench accept --fixtures "$F" --spec-method "$method" --draft "$draft" \
    "${extra[@]}" "${llm_kwargs[@]}" ${ACCEPT_ARGS:-} --enforce-eager --timeout "${ACCEPT_TIMEOUT:-300}" \
    --out "$OUT/accept_$name.json" > "$OUT/accept_$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start ))s"; tail -4 "$OUT/accept_$name.log"
}

for spec in "$@"; do
  IFS=: read -r name method draft connector <<< "$spec"
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  one_run "$name" "$method" "$draft" "$connector" &
  # staggered starts: engines still initialise one after another on the GPU
  [ "$JOBS" -gt 1 ] && sleep "${ACCEPT_STAGGER_S:-4}"
done
wait

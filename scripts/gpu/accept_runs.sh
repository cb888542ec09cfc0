#!/usr/bin/env bash
# Sequential acceptance-parity runs on the device, one engine at a time.
#   scripts/gpu/accept_runs.sh FIXTURES OUTDIR NAME:METHOD:DRAFT:CONNECTOR ...
# CONNECTOR is ours | native | lmcache | none | corrupt (the KV-sensitivity probe).
set -uo pipefail
# On a bare machine FlashInfer JIT-builds its sampler for minutes at engine start.
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
F=$1; OUT=$2; shift 2
mkdir -p "$OUT"
declare -A KV=(
  [ours]='{"kv_connector":"DraftOffloadConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":8000000000}}'
  [native]='{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":8000000000}}'
  [lmcache]='{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'
  [none]='none'
)
for spec in "$@"; do
  IFS=: read -r name method draft connector <<< "$spec"
  if [ "$connector" = corrupt ]; then extra=(--corrupt-draft-kv); else extra=(--kv-transfer-config "${KV[$connector]}"); fi
  start=$(date +%s)
  python3 scripts/accept_check.py --model "$F/target" --spec-method "$method" --draft "$F/$draft" \
    "${extra[@]}" --enforce-eager --timeout "${ACCEPT_TIMEOUT:-200}" --out "$OUT/accept_$name.json" \
    > "$OUT/accept_$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - start ))s"; tail -4 "$OUT/accept_$name.log"
done

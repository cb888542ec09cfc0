#!/usr/bin/env bash
# One lease's work in phases, so that each device call is short and the next one can
# follow at once (a machine goes back after 30 s without a call). After staging and
# setup.sh:   bash scripts/gpu/lease.sh PHASE
#   fixtures  build /root/fx (Llama family), /root/fx-mtp (MTP) and /root/fx-swa
#             (Gemma-3-shaped, 128-token windows) side by side, in the background
#   poll [N]  the last N lines of every log, and the GPU's use
#   accept    the acceptance runs still missing (MTP, sliding windows, storage restart,
#             32k prompts), JOBS=6 in the background: /root/acc-*
#   serve     serve-bench (eagle3, with and without the connector): /root/serve
#   pressure  the pressure run with per-token margins: /root/pressure
#   l3        restore-speed of the storage tier, default settings, cold and warm restart,
#             then l3-stages (the fetch path's stages against a plain read)
#   decode    decode-overhead at the small shape, 5 batches, then the hooks timed and
#             the memcpy copy path (about 11 min): /root/decode_*.json
#   soak      the 10-minute soak with faults (about 14.5 min): /root/soak
#   hybrid    build /root/fx-hybrid (hybrid-mtp: Qwen3-Next-shaped, Mamba state in
#             vLLM's align mode, random MTP layer), then its acceptance runs one engine
#             at a time, prefix_cache_retention_interval 0 and None: /root/acc-hybrid
#   collect   logs, fixture indexes, tables and tarballs of the results into $OUT
# Long phases run in the background: poll, then `collect` in the call that sees them end.
set -uo pipefail
export PYTHONPATH=/root/proj:/root/site PATH=/root/proj/bin:$PATH HF_HUB_OFFLINE=1 \
  PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
L=/root/logs
mkdir -p "$L"
bg() { local log=$1; shift; (setsid nohup bash -c "$*" > "$L/$log.log" 2>&1 &); }

case "${1:-}" in
fixtures)
  bg fx "bash scripts/gpu/fixtures.sh /root/fx --only target"
  bg fx-mtp "bash scripts/gpu/fixtures.sh /root/fx-mtp --only glm-mtp,glm-mtp2,dsv3-mla-mtp"
  bg fx-swa "bash scripts/gpu/fixtures.sh /root/fx-swa --sliding-window 128"
  sleep 5; tail -n 2 "$L"/fx*.log ;;
poll)
  for f in "$L"/*.log; do echo "== $f"; tail -n "${2:-3}" "$f"; done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader ;;
accept)
  mtp=(); for f in glm-mtp glm-mtp2 dsv3-mla-mtp; do
    for c in corrupt none ours ours_l3 diverge native; do mtp+=("$f-$c:mtp:$f:$c"); done; done
  swa=(self-corrupt:draft_model:self-draft:corrupt self-none:draft_model:self-draft:none
       self-ours:draft_model:self-draft:ours self-ours_l3:draft_model:self-draft:ours_l3
       self-native:draft_model:self-draft:native eagle3-corrupt:eagle3:eagle3:corrupt
       eagle3-ours:eagle3:eagle3:ours eagle3-ours_l3:eagle3:eagle3:ours_l3)
  llama=(self-ours_l3:draft_model:self-draft:ours_l3 small-ours_l3:draft_model:small-draft:ours_l3
         eagle-ours_l3:eagle:eagle:ours_l3 eagle3-ours_l3:eagle3:eagle3:ours_l3)
  long=(eagle3-none:eagle3:eagle3:none eagle3-corrupt:eagle3:eagle3:corrupt
        eagle3-ours:eagle3:eagle3:ours)
  long_mtp=(glm-mtp-none:mtp:glm-mtp:none glm-mtp-corrupt:mtp:glm-mtp:corrupt
            glm-mtp-ours:mtp:glm-mtp:ours)
  bg accept "export JOBS=6
    bash scripts/gpu/accept_runs.sh /root/fx-mtp /root/acc-mtp ${mtp[*]}
    bash scripts/gpu/accept_runs.sh /root/fx-swa /root/acc-swa ${swa[*]}
    bash scripts/gpu/accept_runs.sh /root/fx /root/acc-l3 ${llama[*]}
    export ACCEPT_ARGS='--prompt-tokens 32000' ACCEPT_TIMEOUT=600
    bash scripts/gpu/accept_runs.sh /root/fx /root/acc-32k ${long[*]}
    bash scripts/gpu/accept_runs.sh /root/fx-mtp /root/acc-32k ${long_mtp[*]}
    echo accept-done"
  sleep 3; tail -n 3 "$L/accept.log" ;;
serve)
  bg serve "vllm-draft-offload serve-bench --fixtures /root/fx --out /root/serve; echo serve-done" ;;
pressure)
  bg pressure "vllm-draft-offload pressure --fixtures /root/fx --out /root/pressure; echo pressure-done" ;;
l3)
  bg l3 "vllm-draft-offload restore-speed --enforce-eager --configs ours_l3 --reps 3 \
    --l3-dir /root/l3 --drop-caches --out /root/restore_speed_l3.json
    vllm-draft-offload l3-stages --dir /root/l3-stages --threads 8 --units 32 \
      --engine-loop-ms 0,0.5 --writes 0,32 --piece-kib 1024,4096 --out /root/l3_stages.json
    echo l3-done" ;;
decode)
  bg decode "vllm-draft-offload decode-overhead --shape small --reps 5 --out /root/decode_small.json
    vllm-draft-offload decode-overhead --shape small --configs idle,store --turn-prompts 0 --reps 2 \
      --time-hooks --out /root/decode_hooks_small.json
    vllm-draft-offload decode-overhead --shape small --configs store --copy-path memcpy \
      --turn-prompts 0 --out /root/decode_memcpy_small.json; echo decode-done" ;;
soak)
  bg soak "vllm-draft-offload soak --fixtures /root/fx --out /root/soak --seconds 600 \
    --faults disk_full,outage,corrupt --fault-period 60 --baseline-seconds 90; echo soak-done" ;;
hybrid)
  bg hybrid "bash scripts/gpu/hybrid.sh /root/fx-hybrid /root/acc-hybrid"
  sleep 5; tail -n 3 "$L/hybrid.log" ;;
collect)
  : "${OUT:?collect writes into \$OUT}"
  cp "$L"/*.log "$OUT"/ 2>/dev/null
  for d in fx fx-mtp fx-swa fx-hybrid; do
    [ -f "/root/$d/fixtures.json" ] && cp "/root/$d/fixtures.json" "$OUT/$d-index.json"
    for m in /root/$d/*/fixture_meta.json; do
      [ -f "$m" ] && cp "$m" "$OUT/$d-$(basename "$(dirname "$m")")-meta.json"
    done
  done
  for d in acc-mtp acc-swa acc-l3 acc-32k acc-hybrid/r0 acc-hybrid/rnone; do
    [ -d "/root/$d" ] || continue
    n=${d//\//-}
    vllm-draft-offload table "/root/$d" > "$OUT/$n-table.md" 2>&1
    tar -czf "$OUT/$n.tgz" -C /root "$d"
  done
  [ -d /root/serve ] && tar -czf "$OUT/serve.tgz" -C /root serve
  [ -d /root/pressure ] && cp /root/pressure/pressure.json /root/pressure/pressure.md "$OUT"/
  [ -f /root/restore_speed_l3.json ] && cp /root/restore_speed_l3.json "$OUT"/
  [ -f /root/l3_stages.json ] && cp /root/l3_stages.json "$OUT"/
  cp /root/decode_*.json "$OUT"/ 2>/dev/null
  [ -f /root/soak/soak.md ] && cp /root/soak/soak.json /root/soak/soak.md /root/soak/soak.png "$OUT"/
  ls -la "$OUT" ;;
*)
  sed -n '2,17p' "$0"; exit 2 ;;
esac

#!/usr/bin/env bash
# The page kernel's grid, per-iteration bytes and warps against small pages, the copy
# alone and with the host's planning (copy-speed's device_* and plain columns), then
# the full default copy-speed table. Each variant: PROGRAMS:BLOCK_KIB:WARPS.
#   bash scripts/gpu/copy_sweep.sh OUT_DIR [VARIANT ...]
set -uo pipefail
out=${1:?copy_sweep.sh OUT_DIR [PROGRAMS:BLOCK_KIB:WARPS ...]}; shift
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(32:16:4 64:16:4 32:64:4 32:64:8 64:64:8 128:64:8 32:16:8)
mkdir -p "$out"
for v in "${variants[@]}"; do
  IFS=: read -r programs block warps <<< "$v"
  echo "== variant $v"
  vllm-draft-offload copy-speed --pages-kib 4,8,16,64 --paths kernel --reps 5 \
    --kernel-programs "$programs" --kernel-block-kib "$block" --kernel-warps "$warps" \
    --out "$out/kernel_p${programs}_b${block}_w${warps}.json" 2>&1 | grep -E "KiB|Error|error|Traceback|Exception"
done
echo "== default table"
vllm-draft-offload copy-speed --reps 3 --out "$out/copy_speed.json" 2>&1 | grep -E "KiB|Error|error|Traceback|Exception"

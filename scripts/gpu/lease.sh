#!/usr/bin/env bash
# One lease's work in phases, so that each device call is short and the next one can
# follow at once (a machine goes back after 30 s without a call). After staging and
# setup.sh:   bash scripts/gpu/lease.sh PHASE
#   fixtures  build /root/fx (Llama family), /root/fx-mtp (MTP) and /root/fx-swa
#             (Gemma-3-shaped, 512-token windows: well below the 4k-token prompts)
#             side by side, in the background
#   fx        build /root/fx (Llama family) alone: what serve, pressure and soak need
#   fx-mtp    build /root/fx-mtp (the MTP fixtures) alone; fx-mtp-swa: it and /root/fx-swa
#             side by side, waiting for both (chainable, unlike fixtures)
#   accept-mtp / accept-swa  the MTP or the sliding-window part of accept alone (MTP: none,
#             the no-connector prefix-cache hit control, corrupt, ours, ours_l3, diverge,
#             native and LMCache for each MTP fixture; sliding windows: corrupt (draft KV)
#             and corrupt_window (the target's window KV) for self-draft and eagle3 too)
#   fx-all    build /root/fx, /root/fx-mtp and /root/fx-swa side by side and wait for all
#             three (chainable; the log's fx-all-seconds line is every fixture's build time)
#   fx-long   build /root/fx-long: target, self-draft, eagle3 and glm-mtp with the 32k
#             long-context stage (fixtures --long-context 32768; H100: 283 s)
#   fx-long-all  build /root/fx-long (eagle3, glm-mtp) and /root/fx-long2 (glm-mtp2,
#             dsv3-mla-mtp), each with the 32k stage, side by side
#   accept-long2  32,000-token prompts, JOBS=6: native, LMCache and the prefix-cache
#             control for eagle3 and glm-mtp; ours_l3 and LMCache for glm-mtp2 (the rest
#             ran in session 17); none, hit, corrupt, ours, ours_l3, native and LMCache
#             for dsv3-mla-mtp: /root/acc-long2
#   accept-long  32,000-token prompts on /root/fx-long: none, corrupt and ours for eagle3
#             and glm-mtp, and ours_l3 (storage after a restart): /root/acc-long
#   accept    the acceptance runs still missing (MTP, sliding windows, storage restart,
#             32k prompts), JOBS=6 in the background: /root/acc-*
#   serve     serve-bench (eagle3, with and without the connector): /root/serve
#   pressure  the pressure run with per-token margins: /root/pressure
#   pressure-l3  the same with a CPU tier of 0.1 x the working set and l3.hit_policy
#             always, so that storage serves what the CPU tier dropped: /root/pressure-l3
#   l3        restore-speed of the storage tier, default settings, cold and warm restart,
#             then l3-stages (the fetch path's stages against a plain read)
#   l3-restart  the same restore-speed alone (fill, cold and warm restart), about 5 min
#   l3-variants  restore-speed with three more warm restarts (Python's 5 ms GIL switch
#             interval, 2 write threads, l3.spread_reads on), then l3-speed
#   l3-probe  restore-speed, 2 reps, default settings (fill, cold and warm restart)
#   l3-writes2  restore-speed, 2 reps, one more warm restart with 2 write threads
#   pressure-both  pressure with a CPU tier of 0.3 x the working set and l3.hit_policy
#             always: both tiers serve in one run: /root/pressure-both
#   hybrid-speed  restore-speed at the gpt-oss-20b-like shape (sliding windows, 16k
#             prompts): recompute, native, ours (about 5 min, estimated)
#   decode    decode-overhead at the small shape, 5 batches, then the hooks timed and
#             the memcpy copy path (about 11 min): /root/decode_*.json
#   decode-diag  where an idle connector's decode cost comes from: decode-overhead at the
#             small shape, none/null/idle twice alternating, then native and store
#             (1,024 decode tokens; H100, session 14: more than 15 min, about 90 s an
#             engine): /root/decode_diag_small.json, decode_diag_store_small.json
#   decode-8b  decode-overhead at the Llama-8B shape (GPU-bound), compiled: none, store,
#             idle, native, 4 batches each, and the store engine's multi-turn check:
#             /root/decode_8b.json
#   decode-8b-rounds  decode-overhead at the 8B shape, none and store, 3 compiled engines
#             each, alternating, 3 batches an engine (about 15 min): /root/decode_8b_rounds.json
#   decode-8b-paired  decode-overhead at the 8B shape, none, store and store_dma, 2
#             compiled engines each, 4 pairs of batches an engine (with stores and with
#             the requests opted out of them: the stores' cost inside one engine; about
#             16 min, estimated): /root/decode_8b_paired.json
#   decode-small-paired  the same at the small shape: /root/decode_small_paired.json
#   decode-8b-hooks  decode-overhead at the 8B shape, store and store_dma, one engine
#             each in the child's process, 6 pairs, the hooks timed per batch: what the
#             stores add to the host's work per batch, on and off (about 7 min, estimated)
#   decode-8b-paired2  decode-8b-paired with one engine per config and 6 pairs each
#             (about 10 min, estimated): /root/decode_8b_paired2.json
#   l3-pieces  l3-stages with 256 KiB, 1 MiB and 4 MiB fetch pieces, 8 threads, quiet and
#             beside a 0.5 ms engine loop: whether a smaller piece keeps the checksum in
#             the CPU cache (about 2 min, estimated): /root/l3_stages_pieces.json
#   decode-8b-machine  decode-overhead at the 8B shape, store and none, one compiled
#             engine each, 10 pairs, every batch with what the machine did meanwhile
#             (stolen CPU, SM clock): whether the batches' spread is the machine's
#             (about 7 min, estimated): /root/decode_8b_machine.json
#   decode-8b-machine2  the store engine alone, 16 more pairs: /root/decode_8b_machine2.json
#   decode-8b-procs  decode-overhead at the 8B shape, none and store, 8 pairs each, with
#             the processes that used the CPU in each batch (machine.top_processes):
#             whose work a slow batch's host did (about 6 min, estimated):
#             /root/decode_8b_procs.json
#   decode-8b-dma  store_dma, 8 pairs, the hooks timed, with the machine's state: what
#             the batches that block 365-370 ms in wait_for_save share (about 4 min,
#             estimated): /root/decode_8b_dma.json
#   l3-threads  l3-stages with 8, 12 and 16 read threads, quiet and beside a 0.5 ms
#             engine loop: whether threads beyond the raw read's close the checksum's
#             gap (about 3 min, estimated): /root/l3_stages_t{8,12,16}.json
#   decode-paths  the 8B shape's stores on each copy path: none, store_dma, store_kernel
#             and store (auto), compiled, 4 batches each, the hooks timed, then one
#             profiled batch each: /root/decode_paths_8b.json
#   copy-sweep  copy-speed of the page kernel's grid, bytes per iteration and warps on
#             4-64 KiB pages (the copy alone and with host planning), then the default
#             table (about 3 min, estimated): /root/copy
#   speed-table  restore-speed at the small and 8B shapes: recompute, native, ours and
#             ours_audit (the stored units checked against a recompute), 3 reps (issue 13's
#             one speed table; about 13 min, estimated from session 33's engines)
#   copy-table  the same for the connector's kernel shape alone, then the default table
#             (about 1.5 min, estimated): /root/copy-table
#   l3-probe2  restore-speed, recompute and ours_l3, 2 reps, restarts warmed up with a
#             full-length prompt (recompute's first request: the no-connector control)
#   l3-overlap  l3-probe2 plus a warm restart with l3.overlap_restore on (restore-speed
#             --l3-variants overlap), side by side against the same stored units
#   decode-prof  one profiled batch each of none/null/idle (torch.profiler: wall
#             against GPU busy time): /root/decode_prof_small.json
#   soak      the 10-minute soak with faults (about 14.5 min): /root/soak
#   soak-alt1 / soak-alt2  soak-order shortened (baseline 75 s, ours 165 s, its first 60 s
#             idle, 4 replays; about 8 and 7 min): run back to back, baseline, ours,
#             baseline, ours on one machine: /root/soak-alt1, /root/soak-alt2
#   soak-null  the soak's connector engine on NullConnector (vLLM's connector plumbing
#             alone) after a no-connector baseline (60 s, then 105 s; about 7 min): whether
#             the idle connector's 9-13 % (session 21) is vLLM's or ours: /root/soak-null
#   l3-native  l3-stages with the native and the Python reader side by side (native
#             pieces 128 KiB, 256 KiB, 1 MiB), 8 and 16 threads, quiet and beside a 0.5 ms
#             engine loop (about 4 min, estimated): /root/l3_stages_native_t{8,16}.json
#   copy-4k   copy-speed --layers 16 at 4 and 8 KiB pages, 10 reps (best and median from
#             the job's lists): whether auto reaches 0.8 x at 4 KiB (about 2 min, estimated)
#   decode-8b-many  decode-overhead at the 8B shape, none and store, one compiled engine
#             each, 24 pairs each: the stores' cost inside one engine on the pair-kernel
#             build (about 8 min, estimated): /root/decode_8b_many.json
#   decode-small-many  the same at the small shape, with the multi-turn decode-KV check
#             (about 6 min, estimated): /root/decode_small_many.json
#   accept-llama  acceptance on /root/fx with the pair kernel: none, corrupt, ours and
#             ours_l3 for eagle3 and the self-draft, ours for eagle, JOBS=6 (about 4 min,
#             estimated): /root/acc-llama
#   l3-native10  l3-stages, native reader, 8 and 12 threads, quiet, 10 reps: the warm
#             fetch against the raw read of the same threads (about 3 min, estimated)
#   l3-restart2  l3-restart plus a warm restart with l3.io_threads 12, the raw reads on
#             1, 4, 8 and 12 threads: the warm fetch against the raw read of its own
#             thread count (about 7.5 min, estimated)
#   decode-8b-b64  decode-overhead at the 8B shape, none and store, 64 requests a batch
#             (GPU-bound decode: less host jitter per pair), 16 pairs an engine (about 9
#             min, estimated): /root/decode_8b_b64.json
#   decode-8b-b64-paths  decode-8b-b64 for stores forced onto the kernel (SMs) and the
#             default path (since session 28 DMA at this shape; session 28 ran it as
#             store_dma,store when the default put decode chunks on the kernel: 1.000 and
#             0.939), 16 pairs each (H200: 9.5 min): /root/decode_8b_b64_paths.json
#   decode-8b-b64-diag  decode-overhead at the 8B shape, 64 requests a batch, one engine each
#             of none, null (vLLM's connector plumbing), idle (ours, storing nothing) and
#             store, 3 pairs each: whether the store engine's 0.84 x none with its stores
#             off (session 25) is any connector's, ours idle, or engine spread (about 9 min,
#             estimated): /root/decode_8b_b64_diag.json
#   decode-8b-b64-prof  none and idle at 64 requests, one pair and a batch under
#             torch.profiler each, in the child's process: GPU busy time against wall
#             (about 5 min, estimated): /root/decode_8b_b64_prof.json
#   decode-8b-b64-paths8  decode-8b-b64-paths with 8 pairs an engine (about 6 min,
#             estimated): /root/decode_8b_b64_paths8.json
#   decode-8b-b64-gc  none, null and idle at 64 requests, 3 pairs each, with vLLM's GC
#             debugger on (VLLM_GC_DEBUG=1: every collection's pause, summed per engine
#             as gc_pauses) and each batch's busiest engine threads: whether the slow
#             batches' extra engine CPU is the collector's (about 9 min, estimated):
#             /root/decode_8b_b64_gc.json
#   decode-8b-b64-hooks  decode-overhead at the 8B shape, none and store (the default,
#             since session 28 DMA for this shape's stores), 64 requests a batch, 12 pairs
#             an engine, the hooks timed with each hook's longest call: the default under
#             its own name, and whether DMA stores' wait_for_save stalls (355-376 ms in
#             sessions 19-23 at 16 requests) are one call (about 9 min, estimated):
#             /root/decode_8b_b64_hooks.json
#   decode-8b-b64-thread  decode-overhead at the 8B shape, 64 requests a batch, store (the
#             default when session 30 ran it: stores on the pair kernel; since session 31
#             decode-only steps store by DMA at this shape), store_dma and
#             store_thread (store_thread on: store copies issued off the engine's thread;
#             DMA at this shape only with copy_path memcpy, so run it with --copy-path
#             memcpy in a second engine too), 8 pairs each, hooks timed: decode and the
#             batches' prefill (paired_prefill) side by side (about 12 min, estimated):
#             /root/decode_8b_b64_thread.json
#   decode-8b-b64-phase  decode-overhead at the 8B shape, 64 requests a batch,
#             store_decode_kernel (every store on the pair kernel; session 31 ran this as
#             store, the default then) and store_decode_dma (decode-only steps' stores by
#             DMA, the others on the kernel), 12 pairs each, hooks timed: whether
#             the kernel's prefill (1.005 x, 53 pairs) and DMA's decode (1.033, 36 pairs)
#             add up, decode and prefill paired (H200, session 31: 8.2 min with setup):
#             /root/decode_8b_b64_phase.json
#   decode-8b-b64-default  decode-overhead at the 8B shape, 64 requests a batch, store
#             (the default since session 31: decode-only steps' stores by DMA, the others
#             on the kernel), store_decode_kernel (every store on the kernel, the default
#             before) and store_thread (the default with the copies issued off the
#             engine's thread: in session 31 a storing batch's longest wait_for_save call
#             was 22.6-42.5 ms with decode steps on DMA) and store_staged (store_staging_units 8: gathered
#             into a GPU buffer by the kernel, one DMA a unit), 12 pairs each, hooks
#             timed (H200, session 32: about 14 min with setup): /root/decode_8b_b64_default.json
#   decode-small-b64  decode-overhead at the small shape (32 KiB pages: stores on the
#             kernel), 64 requests a batch, none and store, 12 pairs each, decode steps
#             timed (and store's hooks) (H200, session 32: 5.3 min): /root/decode_small_b64.json
#   decode-small-b64-staged  the same with store_staged only (store_staging_units 8), 12
#             pairs (H200, session 32: 3.9 min with setup): /root/decode_small_b64_staged.json
#   decode-8b-b64-staged  decode-overhead at the 8B shape, 64 requests a batch, store (the
#             default since session 32: staged through up to 8 units), store_unstaged (the
#             default before) and store_thread (staged, issued off the engine's thread:
#             whether it removes staged batches' 11.8-23.5 ms wait_for_save calls), 12
#             pairs each, hooks and decode steps timed (about 12 min, estimated):
#             /root/decode_8b_b64_staged.json
#   decode-8b-b64-staged2  decode-8b-b64-staged without store_thread: store (the
#             default) and store_unstaged, 12 pairs each (H200, session 33: 366 s, one
#             wave at a time); next, the overlapped staged path's first decode sample:
#             /root/decode_8b_b64_staged2.json
#   speed-ours  restore-speed at the small and 8B shapes, ours alone, 3 reps: restore and
#             store GB/s / the same run's pinned memcpy with the default's staged stores
#             (H200, session 33: 106 s): /root/restore_speed_ours.json
#   speed-staged2  restore-speed at the small and 8B shapes, ours and ours_audit, 3 reps:
#             staged stores with the gather and the DMA overlapped (two buffer halves,
#             the DMA on a stream of its own; session 33) against the same run's pinned
#             memcpy, and every stored unit of ours_audit's hits compared with a
#             recompute of every layer (on the host, within the audit's tolerance; about
#             6.5 min, estimated from session 33's engines, where it was cut short):
#             /root/restore_speed_staged2.json
#   speed-unstaged8b  restore-speed at the 8B shape, ours with store_staging_units 0, 3
#             reps: the unstaged store GB/s on the same machine (about 1.5 min,
#             estimated): /root/restore_speed_unstaged8b.json
#   l3-reads12  l3-restart with a warm restart on 12 read threads and 8 write threads
#             (variant reads12), raw reads on 8 and 12 threads (H200, session 27: 5.3
#             min): /root/restore_speed_l3_reads12.json
#   l3-reads8  l3-restart on the defaults since session 27 (12 read and 8 write threads
#             on 16 cores) with a warm restart on the defaults before (variant reads8:
#             8 and 8), raw reads on 8 and 12 threads (about 5.5 min, estimated):
#             /root/restore_speed_l3_reads8.json
#   l3-spread  l3-restart on the defaults with three more warm restarts side by side:
#             spread (l3.spread_reads on: a unit's layers read by several threads, in runs
#             of about 4 MiB, one native call each, so the first units land early), strict
#             (l3.wait_past_allowance off: no waits past the 5 % allowance) and both; raw
#             reads on 12 threads (about 8 min, estimated): /root/restore_speed_l3_spread.json
#   l3-split  l3-restart on the defaults with three more warm restarts side by side:
#             split4 (l3.threads_per_unit 4: each unit's layers read by four threads in one
#             native call, three units at a time on 12 read threads, so the first units
#             land in about a quarter of a unit's time), split4+strict (then the 5 %
#             allowance may suffice: no bets, the bound holds) and strict (about 8 min,
#             estimated): /root/restore_speed_l3_split.json
#   l3-short  l3-restart on the defaults with a split4+strict warm restart beside it, and
#             in each restart per rep a short hit (a prompt whose first chunk is in the CPU
#             tier, the rest new) and a fresh prompt as long as what it computes: session
#             30's partial admissions took 14-37 ms longer than declines from scheduling to
#             first token; whether a hit of one chunk costs that too, every time or only at
#             an engine's first prefill of that length (scheduled_to_first_token_extra_s;
#             H200, session 30: l3-split took 8.6 min, this about 9.5, estimated):
#             /root/restore_speed_l3_short.json
#   l3-speed-spread  l3-speed, 32 units, 4, 8 and 12 threads, warm and cold: the default
#             path against spread reads and units split over 4 threads (threads_per_unit)
#             outside an engine, with each one's first landing
#             (about 2 min, estimated): /root/l3_speed.json
#   pinned-read  scripts/gpu/pinned_read.py: warm page-cache reads on 4, 8 and 12 threads
#             into a pageable buffer, the same buffer registered with the driver (as the
#             CPU tier is) and a cudaHostAlloc one: whether the in-engine warm fetch's
#             0.4-0.6 x of the raw read is the page-locked destination (about 1 min)
#   soak-switch  soak-alt1 with l3.switch_interval_ms null (Python's 5 ms GIL switch
#             interval kept): whether the idle connector's cost is the 0.5 ms interval
#             (about 8 min): /root/soak-switch
#   soak-spy  soak-switch's pair (the baseline 75 s, then ours 120 s, its first 90 s idle)
#             under py-spy (every process, every thread, idle samples too, 100 Hz): where
#             the idle connector engine's step time goes (about 7 min; needs the py-spy
#             wheel staged in /root/wheels before setup.sh): /root/soak-spy
#   soak-final  issue 10's 10-minute soak (600 s, disk full, outage and corrupted units every
#             60 s after a 60 s idle phase, the baseline first, 16 replays; about 15 min):
#             /root/soak-final
#   decode-8b-dma12  decode-8b-dma with a 12 GiB CPU tier (341 slots): whether the
#             365-376 ms wait_for_save stalls follow the slots or the batch count
#   soak-order-stores  soak-order with the idle phase storing and never restoring
#             (--idle-off load): the stores' and the restores' share of the working
#             engine's step time, each inside one engine: /root/soak-order-stores
#   soak-order  the soak's pace gap taken apart (about 7 min, estimated): the no-connector
#             baseline first (90 s), then ours 210 s, its first 90 s with the connector
#             idle (requests store and load nothing), no faults, then the replay on its
#             own engine: idle vs baseline and working vs baseline: /root/soak-order
#   hybrid    build /root/fx-hybrid (hybrid-mtp: Qwen3-Next-shaped, Mamba state in
#             vLLM's align mode, random MTP layer), then its acceptance runs one engine
#             at a time, prefix_cache_retention_interval 0 and None: /root/acc-hybrid
#   chain P.. the phases P.. one after another in ONE background job (log
#             /root/logs/P.log each, then "P-done"): nothing to start between calls
#   await P [S]  wait (at most S s, default 540) until phase P's log says "P-done",
#             then collect; exits 3 at once on a machine that is not set up (it went
#             back and a bare one answered: stage again)
#   reap      kill GPU processes left alive (chain runs it after every phase)
#   poll [N]  the last N lines of every log, and the GPU's use
#   collect   logs, fixture indexes, tables and results as one tarball in $OUT (lease.tgz,
#             or 15 MiB pieces lease.tgz.00, .01, ...: cat lease.tgz.* | tar -xzf -)
# Long phases run in the background: `await` (or poll), then `collect`.
set -uo pipefail
export PYTHONPATH=/root/proj:/root/site PATH=/root/proj/bin:$PATH HF_HUB_OFFLINE=1 \
  PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
L=/root/logs
SELF=$(realpath "$0")
mkdir -p "$L"
bg() { local log=$1; shift; (setsid nohup bash -c "$*" > "$L/$log.log" 2>&1 &); }
set_up() { [ -x /root/proj/bin/vllm-draft-offload ]; }

# The soak's pace gap with several engines per config on one machine (session 20: one
# connector engine at 0.85 x a no-connector baseline, the next, on another machine,
# above it). Two of these back to back give baseline, ours, baseline, ours; shorter
# than soak-order so that both fit one lease after fx.
soak_alt_cmd() {
  echo "vllm-draft-offload soak --fixtures /root/fx --out /root/soak-alt$1 --no-faults \
    --baseline-first --baseline-seconds 75 --seconds 165 --idle-seconds 60 --replay-n 4"
}

accept_cmd() {
  local mtp=() swa llama long long_mtp f c
  for f in glm-mtp glm-mtp2 dsv3-mla-mtp; do
    for c in none hit corrupt ours ours_l3 diverge native lmcache; do mtp+=("$f-$c:mtp:$f:$c"); done; done
  swa=(self-corrupt:draft_model:self-draft:corrupt self-none:draft_model:self-draft:none
       self-ours:draft_model:self-draft:ours self-ours_l3:draft_model:self-draft:ours_l3
       self-native:draft_model:self-draft:native eagle3-corrupt:eagle3:eagle3:corrupt
       eagle3-ours:eagle3:eagle3:ours eagle3-ours_l3:eagle3:eagle3:ours_l3
       self-corrupt_window:draft_model:self-draft:corrupt_window
       eagle3-corrupt_window:eagle3:eagle3:corrupt_window)
  llama=(self-ours_l3:draft_model:self-draft:ours_l3 small-ours_l3:draft_model:small-draft:ours_l3
         eagle-ours_l3:eagle:eagle:ours_l3 eagle3-ours_l3:eagle3:eagle3:ours_l3)
  long=(eagle3-none:eagle3:eagle3:none eagle3-corrupt:eagle3:eagle3:corrupt
        eagle3-ours:eagle3:eagle3:ours)
  long_mtp=(glm-mtp-none:mtp:glm-mtp:none glm-mtp-corrupt:mtp:glm-mtp:corrupt
            glm-mtp-ours:mtp:glm-mtp:ours)
  case ${1:-all} in
  long2)
    local l2=() f2=()
    for f in eagle3:eagle3 glm-mtp:mtp; do
      for c in hit native lmcache; do l2+=("${f%%:*}-$c:${f#*:}:${f%%:*}:$c"); done; done
    # glm-mtp2's none, hit, corrupt, ours and native ran in session 17 (H100, lease 2).
    for c in ours_l3 lmcache; do f2+=("glm-mtp2-$c:mtp:glm-mtp2:$c"); done
    for c in none hit corrupt ours ours_l3 native lmcache; do
      f2+=("dsv3-mla-mtp-$c:mtp:dsv3-mla-mtp:$c"); done
    # /root/ours_extra, when present, adds connector settings (e.g. ,"copy_path":"memcpy").
    echo "export JOBS=\${JOBS:-6} ACCEPT_ARGS='--prompt-tokens 32000' ACCEPT_TIMEOUT=600
    export OURS_EXTRA=\$(cat /root/ours_extra 2>/dev/null)
    bash scripts/gpu/accept_runs.sh /root/fx-long2 /root/acc-long2 ${f2[*]}
    bash scripts/gpu/accept_runs.sh /root/fx-long /root/acc-long2 ${l2[*]}"; return ;;
  mtp) echo "export JOBS=6; bash scripts/gpu/accept_runs.sh /root/fx-mtp /root/acc-mtp ${mtp[*]}"; return ;;
  long) echo "export JOBS=4 ACCEPT_ARGS='--prompt-tokens 32000' ACCEPT_TIMEOUT=600
    bash scripts/gpu/accept_runs.sh /root/fx-long /root/acc-long ${long[*]} ${long_mtp[*]} \
      glm-mtp-ours_l3:mtp:glm-mtp:ours_l3 eagle3-ours_l3:eagle3:eagle3:ours_l3"; return ;;
  swa) echo "export JOBS=6; bash scripts/gpu/accept_runs.sh /root/fx-swa /root/acc-swa ${swa[*]}"; return ;;
  esac
  echo "export JOBS=6
    bash scripts/gpu/accept_runs.sh /root/fx-mtp /root/acc-mtp ${mtp[*]}
    bash scripts/gpu/accept_runs.sh /root/fx-swa /root/acc-swa ${swa[*]}
    bash scripts/gpu/accept_runs.sh /root/fx /root/acc-l3 ${llama[*]}
    export ACCEPT_ARGS='--prompt-tokens 32000' ACCEPT_TIMEOUT=600
    bash scripts/gpu/accept_runs.sh /root/fx /root/acc-32k ${long[*]}
    bash scripts/gpu/accept_runs.sh /root/fx-mtp /root/acc-32k ${long_mtp[*]}"
}

L3_RESTART="vllm-draft-offload restore-speed --enforce-eager --configs ours_l3 --reps 3 \
  --l3-dir /root/l3 --drop-caches --out /root/restore_speed_l3.json"
# Default settings, then warm restarts with Python's GIL switch interval, with two
# write threads, and with l3.spread_reads on; then the fetch paths alone against raw reads.
L3_VARIANTS="vllm-draft-offload restore-speed --enforce-eager --configs ours_l3 --reps 3 \
  --l3-variants interval5,writes2,spread --l3-dir /root/l3v --drop-caches \
  --out /root/restore_speed_l3_variants.json
  vllm-draft-offload l3-speed --url fs:///root/l3-speed --threads 1,4,8 --units 16 \
    --drop-caches --out /root/l3_speed.json"
# The foreground command of each background phase.
declare -A CMD=(
  [fx]="bash scripts/gpu/fixtures.sh /root/fx --only target"
  [serve]="vllm-draft-offload serve-bench --fixtures /root/fx --out /root/serve"
  [pressure]="vllm-draft-offload pressure --fixtures /root/fx --out /root/pressure"
  [pressure-l3]="vllm-draft-offload pressure --fixtures /root/fx --out /root/pressure-l3 \
    --cpu-fraction 0.1 --l3-hit-policy always"
  [pressure-both]="vllm-draft-offload pressure --fixtures /root/fx --out /root/pressure-both \
    --cpu-fraction 0.3 --l3-hit-policy always"
  [l3-restart]="$L3_RESTART"
  [l3-probe]="vllm-draft-offload restore-speed --enforce-eager --configs ours_l3 --reps 2 \
    --l3-dir /root/l3p --drop-caches --out /root/restore_speed_l3_probe.json"
  [l3-writes2]="vllm-draft-offload restore-speed --enforce-eager --configs ours_l3 --reps 2 \
    --l3-variants writes2 --l3-dir /root/l3w --drop-caches --out /root/restore_speed_l3_writes2.json
    rm -rf /root/l3w"
  [l3-variants]="$L3_VARIANTS"
  [l3]="$L3_RESTART
    vllm-draft-offload l3-stages --dir /root/l3-stages --threads 8 --units 32 \
      --engine-loop-ms 0,0.5,5 --writes 0,32 --switch-interval-ms 5,0.5 --out /root/l3_stages.json"
  [decode]="vllm-draft-offload decode-overhead --shape small --reps 5 --out /root/decode_small.json
    vllm-draft-offload decode-overhead --shape small --configs idle,store --turn-prompts 0 --reps 2 \
      --time-hooks --out /root/decode_hooks_small.json
    vllm-draft-offload decode-overhead --shape small --configs store --copy-path memcpy \
      --turn-prompts 0 --out /root/decode_memcpy_small.json"
  [decode-diag]="vllm-draft-offload decode-overhead --shape small --configs none,null,idle \
      --rounds 2 --reps 4 --decode-tokens 1024 --turn-prompts 0 --out /root/decode_diag_small.json
    vllm-draft-offload decode-overhead --shape small --configs native,store --reps 4 \
      --decode-tokens 1024 --turn-prompts 0 --out /root/decode_diag_store_small.json
"
  [decode-8b]="vllm-draft-offload decode-overhead --shape llama8b --configs none,store,idle,native \
      --reps 4 --out /root/decode_8b.json"
  [decode-paths]="vllm-draft-offload decode-overhead --shape llama8b \
      --configs none,store_dma,store_kernel,store --reps 4 --turn-prompts 0 --time-hooks --profile \
      --out /root/decode_paths_8b.json"
  [copy-sweep]="bash scripts/gpu/copy_sweep.sh /root/copy"
  [speed-table]="vllm-draft-offload restore-speed --enforce-eager --shape small,llama8b \
    --configs recompute,native,ours,ours_audit --reps 3 --out /root/restore_speed_table.json"
  [copy-table]="bash scripts/gpu/copy_sweep.sh /root/copy-table 32:16:4"
  [l3-probe2]="vllm-draft-offload restore-speed --enforce-eager --configs recompute,ours_l3 --reps 2 \
    --l3-dir /root/l3p2 --drop-caches --engine-timeout 300 --out /root/restore_speed_l3_probe2.json"
  [l3-overlap]="vllm-draft-offload restore-speed --enforce-eager --configs recompute,ours_l3 --reps 2 \
    --l3-variants overlap --l3-dir /root/l3o --drop-caches --engine-timeout 300 \
    --out /root/restore_speed_l3_overlap.json"
  [decode-8b-rounds]="vllm-draft-offload decode-overhead --shape llama8b --configs none,store \
      --rounds 3 --reps 3 --turn-prompts 0 --engine-timeout 400 --out /root/decode_8b_rounds.json"
  [decode-8b-paired]="vllm-draft-offload decode-overhead --shape llama8b \
      --configs none,store,store_dma --rounds 2 --reps 4 --turn-prompts 0 --engine-timeout 400 \
      --out /root/decode_8b_paired.json"
  [decode-small-paired]="vllm-draft-offload decode-overhead --shape small \
      --configs none,store,store_dma --rounds 2 --reps 4 --turn-prompts 0 --engine-timeout 400 \
      --out /root/decode_small_paired.json"
  [decode-8b-hooks]="vllm-draft-offload decode-overhead --shape llama8b --configs store,store_dma \
      --reps 6 --turn-prompts 0 --time-hooks --engine-timeout 400 --out /root/decode_8b_hooks.json"
  [decode-8b-paired2]="vllm-draft-offload decode-overhead --shape llama8b \
      --configs none,store,store_dma --reps 6 --turn-prompts 0 --engine-timeout 400 \
      --out /root/decode_8b_paired2.json"
  [l3-pieces]="vllm-draft-offload l3-stages --dir /root/l3-stages --threads 8 --units 32 \
      --engine-loop-ms 0,0.5 --writes 0 --piece-kib 256,1024,4096 --switch-interval-ms 0.5 \
      --out /root/l3_stages_pieces.json; rm -rf /root/l3-stages"
  [decode-8b-machine]="vllm-draft-offload decode-overhead --shape llama8b \
      --configs store,none --reps 10 --turn-prompts 0 --engine-timeout 500 \
      --out /root/decode_8b_machine.json"
  [decode-8b-machine2]="vllm-draft-offload decode-overhead --shape llama8b \
      --configs store --reps 16 --turn-prompts 0 --engine-timeout 500 \
      --out /root/decode_8b_machine2.json"
  [decode-8b-procs]="vllm-draft-offload decode-overhead --shape llama8b \
      --configs none,store --reps 8 --turn-prompts 0 --engine-timeout 500 \
      --out /root/decode_8b_procs.json"
  [decode-8b-dma12]="vllm-draft-offload decode-overhead --shape llama8b --configs store_dma \
      --reps 8 --turn-prompts 0 --time-hooks --engine-timeout 500 --cpu-gib 12 \
      --out /root/decode_8b_dma12.json"
  [decode-8b-dma]="vllm-draft-offload decode-overhead --shape llama8b --configs store_dma \
      --reps 8 --turn-prompts 0 --time-hooks --engine-timeout 500 --out /root/decode_8b_dma.json"
  [l3-threads]="for t in 8 12 16; do vllm-draft-offload l3-stages --dir /root/l3-stages \
      --threads \$t --units 32 --engine-loop-ms 0,0.5 --writes 0 --switch-interval-ms 0.5 \
      --out /root/l3_stages_t\$t.json; rm -rf /root/l3-stages; done"
  [decode-prof]="vllm-draft-offload decode-overhead --shape small --configs none,null,idle --reps 1 \
      --turn-prompts 0 --profile --out /root/decode_prof_small.json"
  [soak]="vllm-draft-offload soak --fixtures /root/fx --out /root/soak --seconds 600 \
    --faults disk_full,outage,corrupt --fault-period 60 --baseline-seconds 90"
  [soak-order]="vllm-draft-offload soak --fixtures /root/fx --out /root/soak-order --no-faults \
    --baseline-first --baseline-seconds 90 --seconds 210 --idle-seconds 90 --replay-n 8"
  [soak-null]="vllm-draft-offload soak --fixtures /root/fx --out /root/soak-null --no-faults \
    --baseline-first --baseline-seconds 60 --seconds 105 --ours-connector null --replay-n 4"
  [copy-4k]="vllm-draft-offload copy-speed --layers 16 --pages-kib 4,8 --paths memcpy,kernel,auto \
      --reps 10 --out /root/copy_4k.json"
  [decode-8b-many]="vllm-draft-offload decode-overhead --shape llama8b --configs none,store \
      --reps 24 --turn-prompts 0 --engine-timeout 600 --out /root/decode_8b_many.json"
  [decode-small-many]="vllm-draft-offload decode-overhead --shape small --configs none,store \
      --reps 24 --engine-timeout 600 --out /root/decode_small_many.json"
  [accept-llama]="export JOBS=6; bash scripts/gpu/accept_runs.sh /root/fx /root/acc-llama \
      eagle3-none:eagle3:eagle3:none eagle3-corrupt:eagle3:eagle3:corrupt \
      eagle3-ours:eagle3:eagle3:ours eagle3-ours_l3:eagle3:eagle3:ours_l3 \
      self-none:draft_model:self-draft:none self-corrupt:draft_model:self-draft:corrupt \
      self-ours:draft_model:self-draft:ours self-ours_l3:draft_model:self-draft:ours_l3 \
      eagle-ours:eagle:eagle:ours"
  [l3-native10]="for t in 8 12; do vllm-draft-offload l3-stages --dir /root/l3-stages \
      --threads \$t --units 32 --engine-loop-ms 0 --writes 0 --reader native --reps 10 \
      --out /root/l3_stages_native10_t\$t.json; rm -rf /root/l3-stages; done"
  [l3-restart2]="vllm-draft-offload restore-speed --enforce-eager --configs ours_l3 --reps 3 \
      --l3-variants threads12 --raw-threads 1,4,8,12 --l3-dir /root/l3r2 --drop-caches \
      --out /root/restore_speed_l3_threads.json; rm -rf /root/l3r2"
  [decode-8b-b64]="vllm-draft-offload decode-overhead --shape llama8b --configs none,store \
      --reps 16 --batch 64 --turn-prompts 0 --engine-timeout 600 --out /root/decode_8b_b64.json"
  [decode-8b-b64-paths]="vllm-draft-offload decode-overhead --shape llama8b \
      --configs store_kernel,store --reps 16 --batch 64 --turn-prompts 0 --engine-timeout 600 \
      --out /root/decode_8b_b64_paths.json"
  [decode-8b-b64-diag]="vllm-draft-offload decode-overhead --shape llama8b \
      --configs none,null,idle,store --reps 3 --batch 64 --turn-prompts 0 --engine-timeout 600 \
      --out /root/decode_8b_b64_diag.json"
  [decode-8b-b64-prof]="vllm-draft-offload decode-overhead --shape llama8b --configs none,idle \
      --reps 1 --batch 64 --turn-prompts 0 --profile --engine-timeout 600 \
      --out /root/decode_8b_b64_prof.json"
  [decode-8b-b64-paths8]="vllm-draft-offload decode-overhead --shape llama8b \
      --configs store_dma,store --reps 8 --batch 64 --turn-prompts 0 --engine-timeout 600 \
      --out /root/decode_8b_b64_paths8.json"
  [decode-8b-b64-gc]="VLLM_GC_DEBUG=1 vllm-draft-offload decode-overhead --shape llama8b \
      --configs none,null,idle --reps 3 --batch 64 --turn-prompts 0 --engine-timeout 600 \
      --out /root/decode_8b_b64_gc.json"
  [decode-8b-b64-hooks]="vllm-draft-offload decode-overhead --shape llama8b \
      --configs none,store --reps 12 --batch 64 --turn-prompts 0 --time-hooks \
      --engine-timeout 600 --out /root/decode_8b_b64_hooks.json"
  [decode-8b-b64-thread]="vllm-draft-offload decode-overhead --shape llama8b \
      --configs store,store_dma,store_thread --reps 8 --batch 64 --turn-prompts 0 --time-hooks \
      --engine-timeout 600 --out /root/decode_8b_b64_thread.json; \
      vllm-draft-offload decode-overhead --shape llama8b --configs store_thread \
      --copy-path memcpy --reps 8 --batch 64 --turn-prompts 0 --time-hooks \
      --engine-timeout 600 --out /root/decode_8b_b64_thread_dma.json"
  [decode-8b-b64-phase]="vllm-draft-offload decode-overhead --shape llama8b \
      --configs store_decode_kernel,store_decode_dma --reps 12 --batch 64 --turn-prompts 0 \
      --time-hooks --engine-timeout 600 --out /root/decode_8b_b64_phase.json"
  [decode-8b-b64-default]="vllm-draft-offload decode-overhead --shape llama8b \
      --configs store,store_decode_kernel,store_thread,store_staged --reps 12 --batch 64 \
      --turn-prompts 0 \
      --time-hooks --engine-timeout 600 --out /root/decode_8b_b64_default.json"
  [decode-small-b64]="vllm-draft-offload decode-overhead --shape small --configs none,store \
      --reps 12 --batch 64 --turn-prompts 0 --time-hooks --engine-timeout 600 \
      --out /root/decode_small_b64.json"
  [decode-8b-b64-staged]="vllm-draft-offload decode-overhead --shape llama8b \
      --configs store,store_unstaged,store_thread --reps 12 --batch 64 --turn-prompts 0 \
      --time-hooks --engine-timeout 600 --out /root/decode_8b_b64_staged.json"
  [decode-8b-b64-staged2]="vllm-draft-offload decode-overhead --shape llama8b \
      --configs store,store_unstaged --reps 12 --batch 64 --turn-prompts 0 \
      --time-hooks --engine-timeout 600 --out /root/decode_8b_b64_staged2.json"
  [speed-ours]="vllm-draft-offload restore-speed --enforce-eager --shape small,llama8b \
    --configs ours --reps 3 --out /root/restore_speed_ours.json"
  [speed-staged2]="vllm-draft-offload restore-speed --enforce-eager --shape small,llama8b \
    --configs ours,ours_audit --reps 3 --out /root/restore_speed_staged2.json"
  [speed-unstaged8b]="vllm-draft-offload restore-speed --enforce-eager --shape llama8b \
    --configs ours --store-staging-units 0 --reps 3 --out /root/restore_speed_unstaged8b.json"
  [decode-small-b64-staged]="vllm-draft-offload decode-overhead --shape small \
      --configs store_staged --reps 12 --batch 64 --turn-prompts 0 --time-hooks \
      --engine-timeout 600 --out /root/decode_small_b64_staged.json"
  [l3-reads12]="vllm-draft-offload restore-speed --enforce-eager --configs ours_l3 --reps 3 \
      --l3-variants reads12 --raw-threads 8,12 --l3-dir /root/l3r3 --drop-caches \
      --out /root/restore_speed_l3_reads12.json; rm -rf /root/l3r3"
  [l3-reads8]="vllm-draft-offload restore-speed --enforce-eager --configs ours_l3 --reps 3 \
      --l3-variants reads8 --raw-threads 8,12 --l3-dir /root/l3r4 --drop-caches \
      --out /root/restore_speed_l3_reads8.json; rm -rf /root/l3r4"
  [l3-spread]="vllm-draft-offload restore-speed --enforce-eager --configs ours_l3 --reps 3 \
      --l3-variants spread,strict,spread+strict --raw-threads 12 --l3-dir /root/l3r5 \
      --drop-caches --out /root/restore_speed_l3_spread.json; rm -rf /root/l3r5"
  [l3-split]="vllm-draft-offload restore-speed --enforce-eager --configs ours_l3 --reps 3 \
      --l3-variants split4,split4+strict,strict --raw-threads 12 --l3-dir /root/l3r6 \
      --drop-caches --out /root/restore_speed_l3_split.json; rm -rf /root/l3r6"
  [l3-short]="vllm-draft-offload restore-speed --enforce-eager --configs ours_l3 --reps 3 \
      --l3-variants split4+strict --short-hit-chunks 1 --raw-threads 12 --l3-dir /root/l3r7 \
      --drop-caches --out /root/restore_speed_l3_short.json; rm -rf /root/l3r7"
  [l3-speed-spread]="vllm-draft-offload l3-speed --url fs:///root/l3-speed --threads 4,8,12 \
      --units 32 --modes warm,cold --drop-caches --out /root/l3_speed.json; rm -rf /root/l3-speed"
  [pinned-read]="python3 scripts/gpu/pinned_read.py; rm -rf /root/pr"
  [l3-native]="for t in 8 16; do vllm-draft-offload l3-stages --dir /root/l3-stages \
      --threads \$t --units 32 --engine-loop-ms 0,0.5 --writes 0 --switch-interval-ms 0.5 \
      --reader native,python --native-piece-kib 128,256,1024 \
      --out /root/l3_stages_native_t\$t.json; rm -rf /root/l3-stages; done"
  [soak-switch]="vllm-draft-offload soak --fixtures /root/fx --out /root/soak-switch --no-faults \
    --baseline-first --baseline-seconds 75 --seconds 165 --idle-seconds 60 --replay-n 4 \
    --l3-switch-interval-ms none"
  [soak-spy]="mkdir -p /root/soak-spy && /root/site/bin/py-spy record --subprocesses \
    --nonblocking --threads --idle --format raw -r 100 -o /root/soak-spy/spy.raw -- \
    vllm-draft-offload soak --fixtures /root/fx --out /root/soak-spy --no-faults --baseline-first \
    --baseline-seconds 75 --seconds 120 --idle-seconds 90 --replay-n 2; \
    gzip -f /root/soak-spy/spy.raw"
  [soak-final]="vllm-draft-offload soak --fixtures /root/fx --out /root/soak-final --seconds 600 \
    --faults disk_full,outage,corrupt --fault-period 60 --baseline-first --baseline-seconds 90 \
    --idle-seconds 60 --replay-n 16"
  [soak-alt1]="$(soak_alt_cmd 1)"
  [soak-alt2]="$(soak_alt_cmd 2)"
  [soak-order-stores]="vllm-draft-offload soak --fixtures /root/fx --out /root/soak-order-stores \
    --no-faults --baseline-seconds 0 --seconds 210 --idle-seconds 90 --idle-off load --replay-n 8"
  [hybrid]="bash scripts/gpu/hybrid.sh /root/fx-hybrid /root/acc-hybrid"
  [hybrid-speed]="vllm-draft-offload restore-speed --enforce-eager --shape gptoss20b \
    --configs recompute,native,ours --reps 3 --out /root/restore_speed_gptoss.json"
  [accept]="$(accept_cmd)"
  [accept-mtp]="$(accept_cmd mtp)"
  [accept-swa]="$(accept_cmd swa)"
  [fx-long]="bash scripts/gpu/fixtures.sh /root/fx-long --only eagle3,glm-mtp --long-context 32768"
  [accept-long]="$(accept_cmd long)"
  [accept-long2]="$(accept_cmd long2)"
  [fx-all]="start=\$(date +%s)
    bash scripts/gpu/fixtures.sh /root/fx --only target > $L/fx.log 2>&1 &
    bash scripts/gpu/fixtures.sh /root/fx-mtp --only glm-mtp,glm-mtp2,dsv3-mla-mtp > $L/fx-mtp.log 2>&1 &
    bash scripts/gpu/fixtures.sh /root/fx-swa --sliding-window 512 > $L/fx-swa.log 2>&1 &
    wait; tail -n 3 $L/fx.log $L/fx-mtp.log $L/fx-swa.log
    echo fx-all-seconds \$(( \$(date +%s) - start ))"
  [fx-long-all]="start=\$(date +%s)
    bash scripts/gpu/fixtures.sh /root/fx-long --only eagle3,glm-mtp --long-context 32768 \
      > $L/fx-long1.log 2>&1 &
    bash scripts/gpu/fixtures.sh /root/fx-long2 --only glm-mtp2,dsv3-mla-mtp --long-context 32768 \
      > $L/fx-long2.log 2>&1 &
    wait; tail -n 3 $L/fx-long1.log $L/fx-long2.log
    echo fx-long-all-seconds \$(( \$(date +%s) - start ))"
  [fx-mtp]="bash scripts/gpu/fixtures.sh /root/fx-mtp --only glm-mtp,glm-mtp2,dsv3-mla-mtp"
  [fx-mtp-swa]="bash scripts/gpu/fixtures.sh /root/fx-mtp --only glm-mtp,glm-mtp2,dsv3-mla-mtp \
      > $L/fx-mtp.log 2>&1 &
    bash scripts/gpu/fixtures.sh /root/fx-swa --sliding-window 512 > $L/fx-swa.log 2>&1 &
    wait; tail -n 3 $L/fx-mtp.log $L/fx-swa.log"
)

phase=${1:-}
case "$phase" in
poll|collect|reap|"") ;;
*) set_up || { echo "lease.sh: not set up on this machine (a bare one?): stage, setup.sh" >&2; exit 3; } ;;
esac

case "$phase" in
fixtures)
  bg fx "${CMD[fx]}; echo fx-done"
  bg fx-mtp "bash scripts/gpu/fixtures.sh /root/fx-mtp --only glm-mtp,glm-mtp2,dsv3-mla-mtp; echo fx-mtp-done"
  bg fx-swa "bash scripts/gpu/fixtures.sh /root/fx-swa --sliding-window 512; echo fx-swa-done"
  sleep 5; tail -n 2 "$L"/fx*.log ;;
chain)
  shift
  script=""
  for p in "$@"; do
    [ -n "${CMD[$p]:-}" ] || { echo "lease.sh chain: no phase $p" >&2; exit 2; }
    # a phase's engines left on the GPU would stop the next phase's from starting
    # (session 8: six pressure engines held 7.8 GB, and vllm serve refused to start)
    script+="{ ${CMD[$p]}; } > $L/$p.log 2>&1; bash $SELF reap >> $L/$p.log 2>&1
echo $p-done >> $L/$p.log
"
  done
  bg chain "$script"
  echo "chain started: $*" ;;
await)
  p=${2:?await PHASE [SECONDS]}; limit=${3:-540}; start=$(date +%s)
  until grep -q "^$p-done" "$L/$p.log" 2>/dev/null; do
    [ $(( $(date +%s) - start )) -ge "$limit" ] && { echo "await $p: not done after ${limit}s"; break; }
    sleep 5
  done
  tail -n 5 "$L/$p.log" 2>/dev/null
  [ -n "${OUT:-}" ] && bash "$SELF" collect > /dev/null ;;
reap)
  # GPU processes still alive between phases: logged, then killed
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    echo "reap: killing GPU process $pid left behind: $(ps -o args= -p "$pid" | cut -c1-120)"
    kill -9 "$pid" 2>/dev/null
  done ;;
poll)
  for f in "$L"/*.log; do echo "== $f"; tail -n "${2:-3}" "$f"; done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader ;;
collect)
  # One tarball of everything (a call brings back at most 8 files of 16 MiB each),
  # split into 15 MiB pieces when larger: cat lease.tgz.* | tar -xzf -
  : "${OUT:?collect writes into \$OUT}"
  C=/root/collect; rm -rf "$C"; mkdir -p "$C"
  cp "$L"/*.log "$C"/ 2>/dev/null
  for d in fx fx-mtp fx-swa fx-long fx-long2 fx-hybrid; do
    [ -f "/root/$d/fixtures.json" ] && cp "/root/$d/fixtures.json" "$C/$d-index.json"
    for m in /root/$d/*/fixture_meta.json; do
      [ -f "$m" ] && cp "$m" "$C/$d-$(basename "$(dirname "$m")")-meta.json"
    done
  done
  for d in acc-mtp acc-swa acc-l3 acc-32k acc-long acc-long2 acc-llama acc-hybrid/r0 acc-hybrid/rnone; do
    [ -d "/root/$d" ] || continue
    vllm-draft-offload table "/root/$d" > "$C/${d//\//-}-table.md" 2>&1
    mkdir -p "$C/$d" && cp -r "/root/$d"/. "$C/$d"/
  done
  [ -d /root/serve ] && cp -r /root/serve "$C"/
  [ -f /root/pressure/pressure.json ] && cp /root/pressure/pressure.json /root/pressure/pressure.md "$C"/
  for d in pressure-l3 pressure-both; do
    [ -f "/root/$d/pressure.json" ] && mkdir -p "$C/$d" &&
      cp "/root/$d/pressure.json" "/root/$d/pressure.md" "$C/$d"/
  done
  cp /root/restore_speed_*.json /root/l3_stages*.json /root/l3_speed.json /root/decode_*.json \
    /root/copy_*.json "$C"/ 2>/dev/null
  for d in copy copy-table; do [ -d "/root/$d" ] && cp -r "/root/$d" "$C"/; done
  [ -f /root/soak/soak.md ] && cp /root/soak/soak.json /root/soak/soak.md /root/soak/soak.png "$C"/
  for d in soak-order soak-order-stores soak-alt1 soak-alt2 soak-null soak-switch soak-spy soak-final; do
    [ -f "/root/$d/soak.md" ] && mkdir -p "$C/$d" &&
      cp "/root/$d/soak.json" "/root/$d/soak.md" "/root/$d/soak.png" "$C/$d"/
  done
  [ -f /root/soak-spy/spy.raw.gz ] && mkdir -p "$C/soak-spy" && cp /root/soak-spy/spy.raw.gz "$C/soak-spy"/
  tar -czf /root/lease.tgz -C /root collect
  if [ "$(stat -c %s /root/lease.tgz)" -le $((15 << 20)) ]; then
    cp /root/lease.tgz "$OUT"/
  else
    split -b 15M -d /root/lease.tgz "$OUT/lease.tgz."
  fi
  ls -la "$OUT" ;;
*)
  # every phase of CMD runs in the background; anything else prints the phases
  if [ -n "$phase" ] && [ -n "${CMD[$phase]:-}" ]; then
    bg "$phase" "${CMD[$phase]}; echo $phase-done"
    sleep 3; tail -n 3 "$L/$phase.log"
  else
    awk 'NR > 1 && !/^#/ {exit} NR > 1' "$SELF"; exit 2
  fi ;;
esac

"""``hook-cost``'s simulated engine: vLLM's real ``Scheduler`` and the worker half of
``DraftOffloadConnector`` on CPU tensors, driven through a batch's steps with the
model runner's connector calls and every draft accepted; the forward is left out."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_draft_offload.bench.speed.decode_configs import connector_config
from vllm_draft_offload.bench.speed.hook_timing import Clock, cpu_time
from vllm_draft_offload.bench.speed.shapes import BLOCK_SIZE, SHAPES, VOCAB, Shape, write_config

OWN_TOKENS = 64  # a prompt's own tokens after a shared prefix (--shared-prefixes)


def max_request_len(args: argparse.Namespace) -> int:
    """A request's tokens at most: its prompt, its decode and the drafts' room."""
    return args.prompt_tokens + args.decode_tokens + 64


def blocks_per_request(args: argparse.Namespace) -> int:
    return -(-max_request_len(args) // BLOCK_SIZE)


class Engine:
    """vLLM's Scheduler (with or without the connector) and the worker connector, with
    the model runner's connector calls in its order (speculative decoding: the worker's
    stores are issued after the drafter, vLLM's ``defer_finalize``)."""

    def __init__(self, args: argparse.Namespace, config: str, work: Path) -> None:
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            SpeculativeConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.plugins import load_general_plugins
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_planning import (
            get_kv_cache_config_from_groups,
            get_kv_cache_groups,
        )
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_request_block_hasher,
            init_none_hash,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        from vllm_draft_offload.connector import DraftOffloadConnector

        load_general_plugins()
        target_shape, draft_shape = SHAPES[args.shape]
        max_len = max_request_len(args)
        target = write_config(work / "target", target_shape, max_len)
        draft = write_config(work / "draft", draft_shape, max_len)
        model_config = ModelConfig(
            model=target, dtype="bfloat16", seed=0, max_model_len=max_len, skip_tokenizer_init=True
        )
        num_tokens = args.batch * args.prompt_tokens
        transfer = None
        connector = connector_config(config, args.cpu_gib, args.chunk_size, max_len)
        if connector is not None:
            # The CPU's copies are memmoves: no kernel table to build (a GPU's is cheap).
            connector["kv_connector_extra_config"]["copy_path"] = "memcpy"
            transfer = KVTransferConfig(**connector)
        self.vllm_config = VllmConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(
                max_num_seqs=max(args.batch, 16),
                max_num_batched_tokens=max(8192, num_tokens),
                max_model_len=max_len,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
            kv_transfer_config=transfer,
            device_config=DeviceConfig("cpu"),
            speculative_config=SpeculativeConfig(
                method="draft_model",
                model=draft,
                num_speculative_tokens=args.spec_tokens,
                target_model_config=model_config,
                target_parallel_config=ParallelConfig(),
            ),
        )
        # FlashAttention's layout on CUDA (NHD): a layer's K and V of a block side by side.
        self.vllm_config.cache_config.kv_cache_layout = "LBNHC"

        def spec(shape: Shape, is_draft: bool) -> FullAttentionSpec:
            return FullAttentionSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=shape["num_key_value_heads"],
                head_size=shape["head_dim"],
                dtype=torch.bfloat16,
                is_draft=is_draft,
            )

        specs = {
            f"model.layers.{i}.self_attn.attn": spec(target_shape, False)
            for i in range(target_shape["num_hidden_layers"])
        } | {
            f"draft_model.model.layers.{i}.self_attn.attn": spec(draft_shape, True)
            for i in range(draft_shape["num_hidden_layers"])
        }
        groups = get_kv_cache_groups(self.vllm_config, specs)
        num_blocks = args.batch * blocks_per_request(args) + 1
        if args.gpu_blocks is not None:
            num_blocks = args.gpu_blocks  # main() checked that one request fits
        page = sum(specs[name].page_size_bytes for g in groups for name in g.layer_names)
        kv_cache_config = get_kv_cache_config_from_groups(
            self.vllm_config, groups, page * num_blocks
        )
        kv_cache_config.num_blocks = num_blocks
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        scheduler_kv = generate_scheduler_kv_cache_config([kv_cache_config])
        block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_kv, self.vllm_config)
        for kv in (kv_cache_config, scheduler_kv):
            kv.hash_block_size = hash_block_size
        self.worker = None
        if connector is not None:
            context = self.vllm_config.compilation_config.static_forward_context
            for name, layer_spec in specs.items():
                context[name] = argparse.Namespace(is_draft_layer=layer_spec.is_draft)
            self.kv_caches = kv_caches = allocate_kv_cache(
                kv_cache_config,
                torch.device("cpu"),
                self.vllm_config.cache_config.get_resolved_kv_cache_layout(),
            )
            self.worker = DraftOffloadConnector(
                self.vllm_config, KVConnectorRole.WORKER, kv_cache_config
            )
            self.worker.register_kv_caches(kv_caches)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=scheduler_kv,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        )
        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(hash_block_size, sha256)
        self.clock = Clock()
        self._wrap_hooks()

    def _wrap_hooks(self) -> None:
        self.clock.wrap_hooks(self.scheduler.connector, self.worker)
        if self.worker is not None:
            # The memmove of CPU tensors: enqueued on a GPU, so timed apart.
            copier = self.worker.worker.copier
            assert copier is not None
            copier._run = self.clock.wrap("copy_exec", copier._run)  # noqa: SLF001

    def add_requests(self, args: argparse.Namespace) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        def tokens(seed: int, n: int) -> list[int]:
            return [(seed * 7919 + j * 131) % (VOCAB - 1000) + 500 for j in range(n)]

        shared = args.shared_prefixes
        prefixes = [tokens(-1 - k, args.prompt_tokens - OWN_TOKENS) for k in range(shared)]
        for i in range(args.batch):
            params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
            params.update_from_generation_config({}, 2)
            if shared:
                # the own tokens from another sequence: a prefix's requests differ there
                prompt = prefixes[i % shared] + tokens(i + 1000, OWN_TOKENS)
            else:
                prompt = tokens(i, args.prompt_tokens)
            request = Request(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling_params=params,
                pooling_params=None,
                block_hasher=self.block_hasher,
            )
            self.scheduler.add_request(request)

    def step(self, spec_tokens: int) -> None:
        from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput

        from vllm_draft_offload.worker_audit import job_slots

        clock = self.clock
        start = cpu_time()
        out = self.scheduler.schedule()
        clock.step["schedule"] += cpu_time() - start
        kv_out = None
        worker = self.worker
        if worker is not None:
            meta = out.kv_connector_metadata
            worker.bind_connector_metadata(meta)
            worker.handle_preemptions(meta)
            worker.start_load_kv(None)
            results = worker.get_transfer_results(out.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_stats=worker.get_kv_connector_stats(),
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            )
            worker.wait_for_save()  # after the drafter (defer_finalize)
            worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens + out.num_scheduled_tokens[req_id]
            prefill_left = request.num_prompt_tokens - done
            # Every draft accepted, plus the bonus token; none while the prompt is cut.
            count = (
                0 if prefill_left > 0 else len(out.scheduled_spec_decode_tokens.get(req_id, ())) + 1
            )
            sampled.append([500 + (done + k) % 1000 for k in range(count)])
        runner_out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=kv_out,
        )
        start = cpu_time()
        self.scheduler.update_from_output(out, runner_out)
        clock.step["update_from_output"] += cpu_time() - start
        live = [r for r in req_ids if r in self.scheduler.requests]
        if spec_tokens and live:
            drafts = [[600 + k for k in range(spec_tokens)] for _ in live]
            self.scheduler.update_draft_token_ids(DraftTokenIds(live, drafts))
        meta = out.kv_connector_metadata if self.worker is not None else None
        stores, loads = (meta.stores, meta.loads) if meta is not None else ([], [])
        layout = self.worker.worker.layout if self.worker is not None else None
        clock.end_step(
            tokens=float(out.total_num_scheduled_tokens),
            store_jobs=float(len(stores)),
            stored_chunks=float(sum(len(job_slots(layout, job)) for job in stores)),
            loaded_chunks=float(sum(len(job_slots(layout, job)) for job in loads)),
            decode=float(all(n <= 1 + spec_tokens for n in out.num_scheduled_tokens.values())),
        )

    def run(self, args: argparse.Namespace) -> None:
        self.add_requests(args)
        while self.scheduler.has_requests() or (
            self.scheduler.connector is not None
            and self.scheduler.connector.scheduler.has_inflight_jobs()
        ):
            self.step(args.spec_tokens)

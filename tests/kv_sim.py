"""A CPU stand-in for vLLM's model runner around the real Scheduler and connector.

Everything vLLM-side is real: VllmConfig, KVCacheConfig from vLLM's own
planner, KV tensors from vLLM's own allocator, the V1 Scheduler, Requests with
real block hashers, both halves of DraftOffloadConnector, and a real
SpeculativeConfig (draft_model, EAGLE, EAGLE3 or multi-module MTP, from
config-only directories), so the connector derives its successor and
min-compute settings as it does in serving. Only the model forward is
simulated, because no attention kernel runs here: each step writes, for every
computed position, KV that is a deterministic function of the token prefix
(and, for EAGLE-style draft layers, of the next token too; of the next S for
S-module MTP). A restore is correct exactly when the KV in the blocks equals
what this function gives.

The simulated forward also reads the cache, as attention does: a sampled token
depends on the bytes of every computed position of every layer, target and
draft, gathered from the request's own blocks. Wrong KV anywhere in the context
therefore changes the outputs, so an output-equality assert checks what was
restored and everything computed on top of it. (A real drafter's KV only moves
acceptance; the simulator is stricter on purpose.)

`SimSetup.sliding_window` makes the model hybrid (Gemma-3-like): vLLM's own
SlidingWindowManager then frees blocks that leave the window to its null block,
and a sliding-window layer's read covers only the window. `SimSetup.mamba` makes
it Qwen3-Next / Nemotron-H-like: Mamba layers whose recurrent state vLLM's own
MambaManager ("align" mode) places per block boundary (tests/mamba_sim.py).

Every store a step plans reads only blocks vLLM's pool holds (ref_cnt > 0): a
block vLLM freed is never copied (`execute` asserts it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import torch
from vllm import SamplingParams
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
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.plugins import load_general_plugins
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from vllm_draft_offload.connector import DraftOffloadConnector
from vllm_draft_offload.metrics import DraftOffloadStats

# The installed package's `vllm.general_plugins` entry point registers the name.
load_general_plugins()

VOCAB = 1000
EOS = 2
TARGET_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def write_tiny_llama(path: Path, layers: int, heads: int, kv_heads: int, head_dim: int) -> Path:
    """A config-only Llama directory: the scheduler never loads weights."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": heads * head_dim,
        "intermediate_size": 2 * heads * head_dim,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": EOS,
        "torch_dtype": "float32",
        "rms_norm_eps": 1e-5,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


EAGLE_ARCHITECTURES = {
    "eagle": "EagleLlamaForCausalLM",
    "eagle3": "Eagle3LlamaForCausalLM",
    # vLLM rewrites a MiMo checkpoint into its MTP modules (MiMoMTPModel).
    "mtp": "MiMoForCausalLM",
}
NUM_SPECULATIVE_TOKENS = 2
MTP_LAYERS = NUM_SPECULATIVE_TOKENS  # multi-module MTP: one module per speculative token


def write_eagle_head(draft_dir: Path, target_dir: Path, method: str) -> Path:
    """A config-only EAGLE/EAGLE3/MTP drafter next to `draft_dir`, with its shape.

    vLLM's SpeculativeConfig takes it as method "eagle"/"eagle3" (it wraps it
    in its EAGLEConfig) or "mtp" (MiMo's multi-module MTP, S = MTP_LAYERS);
    no weights are read. Written beside the draft so that a test that swaps the
    draft directory swaps the drafter's identity too.
    """
    config = json.loads((draft_dir / "config.json").read_text())
    target = json.loads((target_dir / "config.json").read_text())
    config["architectures"] = [EAGLE_ARCHITECTURES[method]]
    if method == "mtp":
        config |= {"model_type": "qwen2", "num_nextn_predict_layers": MTP_LAYERS}
    if method == "eagle3":
        aux_ids = [0, 1, 2]  # vLLM's default ids collapse for a 2-layer target
        config |= {
            "draft_vocab_size": config["vocab_size"],
            "target_hidden_size": target["hidden_size"],
            "eagle_aux_hidden_state_layer_ids": aux_ids,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": aux_ids,
                "use_aux_hidden_state": True,
            },
        }
    path = draft_dir.parent / f"{draft_dir.name}-{method}"
    path.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config)
    file = path / "config.json"
    if not file.exists() or file.read_text() != text:
        file.write_text(text)
    return path


@dataclass
class SimSetup:
    """Which KV geometry the simulated engine has."""

    draft_layout: str = "shared_group"  # or "separate_group"
    eagle: bool = False  # draft KV at p depends on token p+1
    # The speculative method when `eagle`: "eagle", "eagle3" or "mtp" (multi-module, S = 2).
    eagle_method: str = "eagle"
    chunk_size: int = 32
    cpu_units: int = 64
    num_gpu_blocks: int = 96
    extra_config: dict[str, Any] = field(default_factory=dict)
    # TP ranks: one worker connector each, with its own KV tensors (holding the
    # same simulated KV) and host pool; vLLM's KVOutputAggregator merges outputs.
    tp: int = 1
    # Seconds the simulated forward takes per scheduled token, as a device would:
    # the L3 cost policy weighs storage reads against this recompute time.
    compute_s_per_token: float = 0.0
    # A hybrid (Gemma-3-like) model: target layer 0 attends over a sliding window
    # of this many tokens, layer 1 over everything; a draft_model drafter mirrors
    # the target (a self-draft), an EAGLE head is one full-attention layer. vLLM
    # groups the layers (one group per attention type, draft and target mixed) and
    # frees sliding-window blocks that leave the window. `draft_layout` is ignored.
    sliding_window: int | None = None
    # DeepSeek MLA: every layer, draft included, one latent tensor per layer
    # (kv_lora_rank 512 + rope 64 per token, no separate K/V), all in one group.
    mla: bool = False
    # Qwen3-Next / Nemotron-H-like: mamba_sim.MAMBA_LAYERS keep a recurrent state
    # (vLLM's "align" mode), TARGET_LAYERS attend fully, the EAGLE/MTP head attends
    # fully (needs `eagle`). vLLM groups the Mamba layers in groups of their own.
    mamba: bool = False
    # vLLM's prefix_cache_retention_interval (default 0: a Mamba state is kept only at
    # semantic checkpoints, the prompt's replay boundary; None: at every block boundary).
    retention_interval: int | None = 0


MLA_SPEC = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=512 + 64, dtype=torch.bfloat16)


def _draft_spec(setup: SimSetup) -> FullAttentionSpec:
    if setup.draft_layout == "shared_group":
        # Different heads, head size and dtype than the target, same group.
        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    else:
        # Own group: other block size, heads, head size and dtype; vLLM pages
        # of one layout must match, so 32 tokens x 2 heads x 16 x bf16 = 4 KiB.
        spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    return dataclasses.replace(spec, is_draft=True)


SLIDING_TARGET = TARGET_LAYERS[0]  # the sliding-window target layer of a hybrid setup
HYBRID_DRAFT_LAYERS = [f"draft_model.model.layers.{i}.self_attn.attn" for i in range(2)]


def hybrid_specs(vllm_config: VllmConfig, setup: SimSetup) -> dict[str, KVCacheSpec]:
    """Per-layer specs of the hybrid setup, as vLLM's model runner reports them
    (with vLLM's extra_retained_tokens for multi-module MTP, see kv_cache_planning)."""
    assert setup.sliding_window is not None
    shape = {"block_size": 16, "num_kv_heads": 1, "head_size": 32, "dtype": torch.float32}
    extra = max(0, vllm_config.num_prefill_lookahead_tokens - 1)
    window = SlidingWindowSpec(
        **shape, sliding_window=setup.sliding_window, extra_retained_tokens=extra
    )
    full = FullAttentionSpec(**shape)
    specs: dict[str, KVCacheSpec] = {TARGET_LAYERS[0]: window, TARGET_LAYERS[1]: full}
    if setup.eagle:
        specs[f"model.layers.{len(TARGET_LAYERS)}.self_attn.attn"] = dataclasses.replace(
            full, is_draft=True
        )
    else:
        for name, spec in zip(HYBRID_DRAFT_LAYERS, (window, full), strict=True):
            specs[name] = dataclasses.replace(spec, is_draft=True)
    return specs


def mamba_hybrid_specs(vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    from mamba_sim import MAMBA_LAYERS, mamba_spec

    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float32)
    specs: dict[str, KVCacheSpec] = dict.fromkeys(MAMBA_LAYERS, mamba_spec(vllm_config))
    specs |= dict.fromkeys(TARGET_LAYERS, full)
    specs[f"model.layers.{len(TARGET_LAYERS)}.self_attn.attn"] = dataclasses.replace(
        full, is_draft=True
    )
    return specs


def build_kv_cache_config(vllm_config: VllmConfig, setup: SimSetup) -> KVCacheConfig:
    target = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float32)
    if setup.sliding_window is not None or setup.mamba:
        specs = mamba_hybrid_specs(vllm_config) if setup.mamba else hybrid_specs(vllm_config, setup)
        groups = get_kv_cache_groups(vllm_config, specs)
        if vllm_config.speculative_config.use_eagle_block_drop():
            for group in groups:  # as vLLM's get_kv_cache_configs marks them
                group.is_eagle_group = any(specs[name].is_draft for name in group.layer_names)
        page_bytes = sum(
            specs[name].page_size_bytes for group in groups for name in group.layer_names
        )
        config = get_kv_cache_config_from_groups(
            vllm_config, groups, page_bytes * (setup.num_gpu_blocks + 1)
        )
        config.num_blocks = setup.num_gpu_blocks
        config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
        return config
    draft_name = (
        "draft_model.model.layers.0.self_attn.attn"
        if not setup.eagle
        else f"model.layers.{len(TARGET_LAYERS)}.self_attn.attn"
    )
    draft = _draft_spec(setup)
    if setup.mla:
        # vLLM's MTP layer of an MLA model has the target's spec: one group for all.
        groups = [
            KVCacheGroupSpec([*TARGET_LAYERS, draft_name], MLA_SPEC, is_eagle_group=setup.eagle)
        ]
    elif setup.draft_layout == "shared_group":
        from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

        specs = {name: target for name in TARGET_LAYERS} | {draft_name: draft}
        groups = [
            KVCacheGroupSpec(
                list(specs),
                UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs),
                is_eagle_group=setup.eagle,
            )
        ]
    else:
        groups = [
            KVCacheGroupSpec(list(TARGET_LAYERS), target),
            KVCacheGroupSpec([draft_name], draft, is_eagle_group=setup.eagle),
        ]
    page_bytes = sum(
        spec.page_size_bytes
        for group in groups
        for spec in (
            group.kv_cache_spec.kv_cache_specs.values()
            if hasattr(group.kv_cache_spec, "kv_cache_specs")
            else [group.kv_cache_spec] * len(group.layer_names)
        )
    )
    config = get_kv_cache_config_from_groups(
        vllm_config, groups, page_bytes * (setup.num_gpu_blocks + 1)
    )
    config.num_blocks = setup.num_gpu_blocks
    config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    return config


def make_vllm_config(model_dir: Path, draft_dir: Path, setup: SimSetup) -> VllmConfig:
    model_config = ModelConfig(
        model=str(model_dir),
        dtype="float32",
        seed=0,
        max_model_len=2048,
        skip_tokenizer_init=True,
    )
    # successor_tokens and min_compute_tokens are left to the connector, which
    # derives them from the speculative config below (a test may still pin them).
    extra = {"chunk_size": setup.chunk_size, **setup.extra_config}
    if setup.eagle:
        method = setup.eagle_method
        spec_dir = write_eagle_head(draft_dir, model_dir, method)
    else:
        method, spec_dir = "draft_model", draft_dir
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=512,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="DraftOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
        speculative_config=SpeculativeConfig(
            method=method,
            model=str(spec_dir),
            num_speculative_tokens=NUM_SPECULATIVE_TOKENS,
            target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
        ),
    )
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    if setup.mamba:
        from mamba_sim import configure_cache

        assert setup.eagle, "the Mamba hybrid has an EAGLE/MTP head"
        vllm_config.cache_config.prefix_cache_retention_interval = setup.retention_interval
        configure_cache(
            vllm_config,
            FullAttentionSpec(
                block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float32
            ).page_size_bytes,
        )
    return vllm_config


def prompt(seed: int, length: int) -> list[int]:
    """Deterministic token ids, different per seed."""
    return [(seed * 7919 + i * 37) % 900 + 10 for i in range(length)]


def kv_value(layer: str, prefix: tuple[int, ...]) -> float:
    """Deterministic KV content for a position: exact in bf16 and fp32."""
    digest = hashlib.blake2b(repr((layer, prefix)).encode(), digest_size=4).digest()
    return (int.from_bytes(digest, "little") % 255 - 127) / 8.0


def next_token(tokens: list[int], kv_digest: bytes = b"") -> int:
    """The simulated model's greedy choice: a function of the context and of
    the KV read for it (`kv_digest`, see SimEngine.read_kv_digest)."""
    mixed = hashlib.blake2b(repr((tokens[-3:], len(tokens))).encode() + kv_digest, digest_size=8)
    return int.from_bytes(mixed.digest(), "little") % (VOCAB - 10) + 10


class SimEngine:
    def __init__(self, model_dir: Path, draft_dir: Path, setup: SimSetup) -> None:
        self.setup = setup
        self.vllm_config = make_vllm_config(model_dir, draft_dir, setup)
        kv_cache_config = build_kv_cache_config(self.vllm_config, setup)
        self.kv_cache_config = kv_cache_config
        self.unit_bytes = self._unit_bytes(kv_cache_config)
        extra = self.vllm_config.kv_transfer_config.kv_connector_extra_config
        extra.setdefault("cpu_bytes_to_use", self.unit_bytes * setup.cpu_units)
        self.vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        self.kv_caches = allocate_kv_cache(
            kv_cache_config,
            torch.device("cpu"),
            self.vllm_config.cache_config.get_resolved_kv_cache_layout(),
        )
        # What the model runner's attention layers tell the worker: which are draft.
        context = self.vllm_config.compilation_config.static_forward_context
        self.state_names: set[str] = set()
        if setup.mamba:
            from mamba_sim import MAMBA_LAYERS

            self.state_names = set(MAMBA_LAYERS)
        target_names = set(TARGET_LAYERS) | self.state_names
        for name in self.kv_caches:
            context[name] = SimpleNamespace(is_draft_layer=name not in target_names)
        self.workers: list[DraftOffloadConnector] = []
        self.rank_kv_caches = [self.kv_caches]
        for rank in range(setup.tp):
            if rank:
                self.rank_kv_caches.append(
                    allocate_kv_cache(
                        kv_cache_config,
                        torch.device("cpu"),
                        self.vllm_config.cache_config.get_resolved_kv_cache_layout(),
                    )
                )
            connector = DraftOffloadConnector(
                self.vllm_config, KVConnectorRole.WORKER, kv_cache_config
            )
            connector.worker.rank, connector.worker.counts_chunks = rank, rank == 0
            connector.register_kv_caches(self.rank_kv_caches[rank])
            self.workers.append(connector)
        self.worker = self.workers[0]
        self.aggregator = KVOutputAggregator(setup.tp)
        scheduler_kv_cache_config = generate_scheduler_kv_cache_config([kv_cache_config])
        scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
            scheduler_kv_cache_config, self.vllm_config
        )
        for config in (kv_cache_config, scheduler_kv_cache_config):
            config.hash_block_size = hash_block_size
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=scheduler_kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        )
        if setup.tp > 1:
            # One CPU process cannot build a TP>1 ParallelConfig: tell the connector.
            self.scheduler.connector.scheduler.jobs.world_size = setup.tp
        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(hash_block_size, sha256)
        self.outputs: dict[str, list[int]] = {}
        self.published = DraftOffloadStats()
        self.load_metas: list[Any] = []
        self.external_hits: dict[str, int] = {}
        self.hit_sources: dict[str, dict[str, int]] = {}
        self.group_of = {
            name: gid
            for gid, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        self.block_size_of = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        self.draft_names = {name for name in self.kv_caches if name not in target_names}
        self.state = None
        if setup.mamba:
            from mamba_sim import StateForward

            self.state = StateForward(
                self.rank_kv_caches,
                self.group_of,
                self.vllm_config.cache_config.mamba_block_size,
            )
        # Sliding-window layers: attention reads only the last `window` positions.
        self.windows: dict[str, int] = {}
        if setup.sliding_window is not None:
            self.windows[SLIDING_TARGET] = setup.sliding_window
            if not setup.eagle:
                self.windows[HYBRID_DRAFT_LAYERS[0]] = setup.sliding_window
        # Tokens after p that the simulated drafter builds p's draft KV from: the
        # simulator's own truth, which the connector's derived successor_tokens must match.
        self.draft_successors = (
            (MTP_LAYERS if setup.eagle_method == "mtp" else 1) if setup.eagle else 0
        )

    @staticmethod
    def _unit_bytes(kv_cache_config: KVCacheConfig) -> int:
        """An upper bound of a unit (every page of every group): the CPU budget."""
        from vllm_draft_offload.geometry import build_unit_layout

        return build_unit_layout(kv_cache_config, 32).unit_bytes

    # ---------------------------------------------------------------- requests

    def add_request(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        params.update_from_generation_config({}, EOS)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.block_hasher,
        )
        self.scheduler.add_request(request)
        self.outputs[req_id] = []

    def run_until_done(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        connector = self.scheduler.connector.scheduler
        while time.monotonic() < deadline:
            if not self.scheduler.has_requests() and not connector.has_inflight_jobs():
                return
            sched_out = self.step()
            if not sched_out.num_scheduled_tokens:
                time.sleep(0.005)  # waiting on background I/O
        raise AssertionError("simulation did not finish")

    # -------------------------------------------------------------------- step

    def _write_position(
        self, request: Request, position: int, tokens: list[int], layers: list[str]
    ) -> None:
        """Write one position of `layers`; draft layers read `draft_successors`
        tokens after it from `tokens` (the context, plus the sampled token once known)."""
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)
        for name in layers:
            block_size = self.block_size_of[self.group_of[name]]
            block = block_ids[self.group_of[name]][position // block_size]
            value = self.expected_position(name, tokens, position)
            for caches in self.rank_kv_caches:
                caches[name][block, :, position % block_size, :] = value

    def read_kv_digest(
        self, req_id: str, num_target: int, num_draft: int, first_computed: int = 0
    ) -> bytes:
        """What attention reads: the first `num_target` positions of every target
        layer and `num_draft` of every draft layer, as stored in the request's
        blocks, folded into one digest (every byte counts).

        A sliding-window layer reads what this step's positions (from
        `first_computed` on) attend to: their windows. Which positions those are
        depends on how the prompt was split into steps, so, for the output to
        depend on the KV and not on the split, such a layer adds only the positions
        that differ from a fresh prefill's KV (a real model's hidden states, and so
        its later layers and output, change exactly when one of them is wrong).
        """
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        tokens = list(self.scheduler.requests[req_id].all_token_ids)
        digest = hashlib.blake2b(digest_size=16)
        for name, tensor in self.kv_caches.items():
            count = num_draft if name in self.draft_names else num_target
            if count <= 0 or name in self.state_names:
                continue
            window = self.windows.get(name)
            first = 0 if window is None else max(0, min(first_computed, count - 1) - window + 1)
            group = self.group_of[name]
            block_size = self.block_size_of[group]
            table = block_ids[group][first // block_size : -(-count // block_size)]
            assert 0 not in table, f"{name}: attention would read vLLM's null block"
            pages = tensor[torch.tensor(table, dtype=torch.long)]  # a gathered copy
            rows = pages.transpose(1, 2).reshape(-1, pages.shape[1] * pages.shape[3])
            rows = rows[first % block_size : first % block_size + count - first]
            if window is None:
                digest.update(rows.contiguous().view(torch.uint8).numpy().tobytes())
                continue
            for position, row in enumerate(rows, start=first):
                expected = self.expected_position(name, tokens, position)
                if not torch.equal(
                    row.view(tensor.shape[1], -1), expected.expand(tensor.shape[1], -1)
                ):
                    digest.update(repr((name, position)).encode())
                    digest.update(row.contiguous().view(torch.uint8).numpy().tobytes())
        return digest.digest()

    def expected_position(self, name: str, tokens: list[int], position: int) -> torch.Tensor:
        tensor = self.kv_caches[name]
        end = position + 1
        if name in self.draft_names:
            end += self.draft_successors  # the tokens after p its draft KV is built from
        prefix = tuple(tokens[:end])
        value = kv_value(name, prefix)
        return (value + torch.arange(tensor.shape[-1], dtype=torch.float32) % 4).to(tensor.dtype)

    def step(self) -> Any:
        return self.execute(self.scheduler.schedule())

    def execute(self, sched_out: Any) -> Any:
        """Run one scheduled step as vLLM's model runner and its connector mixin do."""
        connector = self.scheduler.connector
        for new in sched_out.scheduled_new_reqs:
            hit = connector.scheduler.restored_tokens(new.req_id)
            self.external_hits[new.req_id] = hit
            # What vLLM files the hit under (its prefix-cache stats by source).
            request = self.scheduler.requests[new.req_id]
            self.hit_sources[new.req_id] = {
                source.value: tokens
                for source, tokens in connector.get_external_cache_hit_sources(request, hit).items()
            }
        meta = sched_out.kv_connector_metadata
        if meta.loads:
            self.load_metas.append(meta)
        pool = self.scheduler.kv_cache_manager.block_pool
        for job in meta.stores:
            for blocks in job.gpu_blocks:
                # (ids past the pool are fault injection: the worker refuses those)
                freed = [
                    b
                    for b in blocks
                    if b < len(pool.blocks) and (b == 0 or not pool.blocks[b].ref_cnt)
                ]
                assert not freed, f"store {job.job_id} reads blocks vLLM freed: {freed}"
        if self.state is not None:
            self.state.forget(sched_out.finished_req_ids)
            self.state.forget(sched_out.preempted_req_ids or ())
            self.state.forget(sched_out.scheduled_cached_reqs.resumed_req_ids)
        for worker in self.workers:
            worker.bind_connector_metadata(meta)
            worker.handle_preemptions(meta)
            # As vLLM's KVConnectorModelRunnerMixin: loads start before the forward
            # only when this step reads one (a synchronous load), else after it.
            if sched_out.has_sync_kv_loads:
                worker.start_load_kv(None)
            if sched_out.num_scheduled_tokens:
                for name in self.kv_caches:
                    worker.wait_for_layer_load(name)
        target_layers = [
            name
            for name in self.kv_caches
            if name not in self.draft_names and name not in self.state_names
        ]
        draft_layers = [name for name in self.kv_caches if name in self.draft_names]
        later = self.draft_successors
        if self.setup.compute_s_per_token:
            time.sleep(self.setup.compute_s_per_token * sched_out.total_num_scheduled_tokens)
        # Positions computed in this step are written first, then the whole
        # context is read back (like attention) and decides the sampled token.
        # Draft KV at p needs the `later` tokens after p: it is written once they
        # are known, so an EAGLE drafter (later = 1) writes the last position's
        # draft KV from the sampled token, after sampling, and a multi-module
        # MTP drafter (later = S) writes position len - S after each sample.
        sampled: dict[str, int] = {}
        deferred: list[tuple[Request, int, list[int]]] = []
        for req_id, num_tokens in sched_out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = request.num_computed_tokens - num_tokens  # already advanced
            tokens = list(request.all_token_ids)
            end = start + num_tokens
            num_draft = min(end, len(tokens) - later)  # leading positions with draft KV
            for position in range(start, end):
                layers = draft_layers if position < num_draft else []
                self._write_position(request, position, tokens, target_layers + layers)
            states = b""
            if self.state is not None:
                block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
                states = self.state.step(req_id, start, end, tokens, block_ids)
            if end >= len(tokens):
                digest = self.read_kv_digest(req_id, end, num_draft, start) + states
                sampled[req_id] = next_token(tokens, digest)
                position = len(tokens) - later  # its last successor is the sampled token
                if later and 0 <= position < end:
                    deferred.append((request, position, [*tokens, sampled[req_id]]))
        for request, position, tokens in deferred:
            self._write_position(request, position, tokens, draft_layers)
        req_ids = list(sched_out.num_scheduled_tokens)
        runner_outs = []
        for worker in self.workers:
            if not sched_out.has_sync_kv_loads:
                worker.start_load_kv(None)
            worker.wait_for_save()
            results = worker.get_transfer_results(sched_out.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_stats=worker.get_kv_connector_stats(),
            )
            worker.clear_connector_metadata()
            runner_outs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in req_ids],
                    logprobs=None,
                    prompt_logprobs_dict={},
                    pooler_output=[],
                    kv_connector_output=kv_out,
                )
            )
        runner_out = (
            runner_outs[0] if len(runner_outs) == 1 else self.aggregator.aggregate(runner_outs)
        )
        engine_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        # Tokens the engine accepted (a step whose KV load failed emits none).
        for outputs in engine_outputs.values():
            for output in outputs.outputs:
                self.outputs[output.request_id] += output.new_token_ids
            # What vLLM publishes to its loggers: worker and scheduler stats merged.
            stats = outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.published.aggregate(DraftOffloadStats(data=stats.kv_connector_stats))
        return sched_out

    def mismatched_positions(self, req_id: str, rank: int = 0) -> list[tuple[str, int]]:
        """(layer, position) pairs whose KV differs from a fresh prefill's (on `rank`)."""
        request = self.scheduler.requests[req_id]
        tokens = list(request.all_token_ids)
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        bad = []
        for name, tensor in self.rank_kv_caches[rank].items():
            if name in self.state_names:
                continue  # no per-position KV: wrong_states checks the state
            group = self.group_of[name]
            block_size = self.block_size_of[group]
            computed = request.num_computed_tokens
            if name in self.draft_names:  # a draft position waits for its successors
                computed = min(computed, len(tokens) - self.draft_successors)
            for position in range(computed):
                block = block_ids[group][position // block_size]
                if block == 0:
                    continue  # out of a sliding window: vLLM freed it (its null block)
                actual = tensor[block, :, position % block_size, :]
                expected = self.expected_position(name, tokens, position)
                if not torch.equal(actual, expected.expand_as(actual)):
                    bad.append((name, position))
        return bad

    def run_prefill(self, req_id: str, timeout_s: float = 30.0) -> None:
        """Step until `req_id` has computed its whole prompt (L3 fetches take wall time)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sched_out = self.step()
            request = self.scheduler.requests.get(req_id)
            if request is not None and request.num_computed_tokens >= request.num_prompt_tokens:
                return
            if request is None and self.outputs.get(req_id):
                raise AssertionError(
                    f"{req_id} finished and was freed in its prefill step (max_tokens=1 with "
                    "no store pending): nothing left to inspect; use max_tokens >= 2"
                )
            if not sched_out.num_scheduled_tokens:
                time.sleep(0.005)  # waiting on background I/O
        raise AssertionError(f"{req_id} did not finish its prefill")

    def shutdown(self) -> None:
        """Stop as vLLM does: workers first (they flush their L3 writes), then the
        scheduler, whose Scheduler.shutdown reaches the scheduler-side connector."""
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()

    def take_published(self) -> dict[str, Any]:
        """Connector stats published since the last call, as vLLM's loggers saw them."""
        data, self.published = self.published.data, DraftOffloadStats()
        return data

    def evict_gpu_kv(self) -> None:
        """Empty the GPU prefix cache and overwrite every block: a later request
        sees only the KV the connector loads."""
        self.scheduler.reset_prefix_cache()
        self.corrupt_device_kv()

    def corrupt_device_kv(self) -> None:
        """Overwrite every GPU block: whatever a later request reads must be loaded."""
        for caches in self.rank_kv_caches:
            for tensor in caches.values():
                tensor.fill_(-99 if tensor.dtype == torch.int8 else -999.0)

    def null_block_bytes(self, rank: int = 0) -> dict[str, bytes]:
        """Every layer's copy of vLLM's null block (block 0): vLLM's stand-in for
        freed sliding-window positions, shared by every request; nothing may write it."""
        return {
            name: tensor[0].contiguous().view(torch.uint8).numpy().tobytes()
            for name, tensor in self.rank_kv_caches[rank].items()
        }


Manager = TypeVar("Manager")


def groups_managed_by(eng: SimEngine, manager: type[Manager]) -> list[tuple[int, int, Manager]]:
    """(layout group index, vLLM group id, vLLM's manager) of each group of the
    connector's layout whose vLLM manager is a `manager` (sliding-window, Mamba...)."""
    layout = eng.scheduler.connector.scheduler.layout
    managers = eng.scheduler.kv_cache_manager.coordinator.single_type_managers
    return [
        (g, group.group_id, managers[group.group_id])
        for g, group in enumerate(layout.groups)
        if isinstance(managers[group.group_id], manager)
    ]

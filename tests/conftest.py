"""Test-wide environment: vLLM runs on the CPU platform, with no model hub."""

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Must be set before vllm is imported anywhere: platform detection reads them once.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).parent))

# The environment the run started with. vLLM engines run in this process set process-wide
# variables (its CPU platform: LD_PRELOAD, LOCAL_WORLD_SIZE, VLLM_SSM_CONV_STATE_LAYOUT,
# thread counts; a worker: VLLM_DIST_IDENT), which later tests' servers would inherit.
STARTUP_ENV = dict(os.environ)


@pytest.fixture(autouse=True)
def _environ_restored() -> Iterator[None]:
    """Each test ends with os.environ as it began (what an in-process engine set is gone)."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(params=["native", "python"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """fast_io's reader for one test: the C extension's GIL-free loop or its Python
    fallback, which unit fetches must treat alike (test_fast_io fails where a compiler
    is present and the extension did not build, so the skip here cannot hide that)."""
    from vllm_draft_offload import fast_io

    if request.param == "native" and not fast_io.AVAILABLE:
        pytest.skip(f"native reader not built: {fast_io.reader()}")
    monkeypatch.setattr(fast_io, "NATIVE", request.param == "native")
    return str(request.param)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Config-only target and draft directories (the draft has another KV geometry)."""
    from kv_sim import write_tiny_llama

    root = tmp_path_factory.mktemp("models")
    return (
        write_tiny_llama(root / "target", layers=2, heads=1, kv_heads=1, head_dim=32),
        write_tiny_llama(root / "draft", layers=1, heads=2, kv_heads=2, head_dim=64),
    )


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A real redis-server on 127.0.0.1 for one test (skipped where none is installed)."""
    from redis_fixture import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server not installed")
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
def vllm_prometheus(model_dirs: tuple[Path, Path]) -> Iterator[object]:
    """vLLM's PrometheusStatLogger as `vllm serve` builds it for an engine with a drafter
    and DraftOffloadConnector, its metrics in prometheus_client's default REGISTRY (what
    /metrics serves); unregistered afterwards."""
    import prometheus_client.values as prometheus_values
    from vllm.config import (
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.plugins import load_general_plugins
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    if prometheus_values.ValueClass is not prometheus_values.MutexValue:
        pytest.skip("prometheus multiprocess mode: families are not in the default REGISTRY")
    load_general_plugins()
    target, draft = model_dirs
    model_config = ModelConfig(model=str(target), skip_tokenizer_init=True, max_model_len=2048)
    vllm_config = VllmConfig(
        model_config=model_config,
        speculative_config=SpeculativeConfig(
            method="draft_model",
            model=str(draft),
            num_speculative_tokens=2,
            target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="DraftOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 30},
        ),
    )
    unregister_vllm_metrics()
    try:
        yield PrometheusStatLogger(vllm_config, engine_indexes=[0])
    finally:
        unregister_vllm_metrics()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_dist() -> Iterator[None]:
    """A 1-rank gloo group, as vLLM's layers need one; torn down for later tests."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    if torch.distributed.is_initialized():  # someone else's group: use it, leave it
        yield
        return
    with set_current_vllm_config(VllmConfig()):  # vLLM's group setup reads a config
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()

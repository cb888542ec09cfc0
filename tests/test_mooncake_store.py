"""L3Store on LMCache's Mooncake-store connector, over TCP, against a real mooncake_master.

Skipped unless the ``mooncake-transfer-engine-non-cuda`` wheel (or the CUDA one) is
installed and loads (it needs ``libibverbs1`` even for TCP). The master binary ships in
the wheel. Mooncake keeps objects in the memory segments its clients contribute, so a
unit lives as long as some client that holds it does.
"""

from __future__ import annotations

import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_fixture import free_port, wait_for_port
from test_l3_store import digest, realistic_unit

from vllm_draft_offload.l3_errors import L3Error
from vllm_draft_offload.l3_store import L3Store

try:
    import mooncake
    from mooncake.store import MooncakeDistributedStore  # noqa: F401  (loads the .so)

    MASTER = Path(mooncake.__file__).parent / "mooncake_master"
except (ImportError, OSError):
    MASTER = None

pytestmark = pytest.mark.skipif(
    MASTER is None or not MASTER.exists(),
    reason="mooncake-transfer-engine(-non-cuda) not installed or libibverbs1 missing",
)


@pytest.fixture
def master(tmp_path: Path) -> Iterator[int]:
    port, metrics = free_port(), free_port()
    with open(tmp_path / "master.log", "wb") as log:
        proc = subprocess.Popen(
            [str(MASTER), f"-rpc_port={port}", f"-metrics_port={metrics}",
             "-rpc_address=127.0.0.1"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for_port(port, 30.0, proc)
        yield port
    finally:
        proc.kill()
        proc.wait(10)


def config(port: int, segment_mb: int = 32) -> dict[str, Any]:
    return {
        "remote_url": f"mooncakestore://127.0.0.1:{port}/",
        "extra_config": {
            "save_chunk_meta": True,
            "draft_offload.l3_namespace": "vdo-mooncake-test",
            "draft_offload.l3_staging_mb": 64,
            "draft_offload.l3_timeout_s": 10.0,
            "mooncake_protocol": "tcp",
            "mooncake_local_hostname": "127.0.0.1",
            "mooncake_metadata_server": "P2PHANDSHAKE",
            # Mooncake 0.3.x's dict setup reads master_server_addr; LMCache 0.5.6's legacy
            # key master_server_address is ignored by it (the client would dial :50051).
            "mooncake_master_server_addr": f"127.0.0.1:{port}",
            "mooncake_global_segment_size": str(segment_mb << 20),
            "mooncake_local_buffer_size": str(16 << 20),
        },
    }


def test_round_trip_misses_and_a_refused_put(master: int) -> None:
    rng = random.Random(7)
    key = rng.randbytes(16).hex()
    blob, _ = realistic_unit(rng, key, target_layer_bytes=256 << 10)
    with L3Store.from_dict(config(master)) as store:
        assert store.healthy()
        store.put(key, blob)
        assert digest(store.get(key)) == digest(blob)
        assert store.get("ab" * 16) is None
        assert store.contains_many([key, "ab" * 16]) == [True, False]
        # Larger than every segment: Mooncake refuses it, and the put says so.
        with pytest.raises(L3Error) as exc:
            store.put("cd" * 16, os.urandom(40 << 20))
        assert exc.value.kind == "io"
        assert store.get("cd" * 16) is None and store.healthy()


def test_a_second_writer_of_one_unit_leaves_the_first_whole(master: int) -> None:
    """Two engines' clients store one unit: Mooncake keeps the first put, whole, and
    the second put is not an error. (Writers are not forked here, unlike the fs/Redis
    test: a process forked from one that holds a Mooncake client hangs.)"""
    first, second = os.urandom(3 << 20), os.urandom(2 << 20)
    with L3Store.from_dict(config(master)) as a, L3Store.from_dict(config(master)) as b:
        a.put("5ea7ed", first)
        b.put("5ea7ed", second)
        assert digest(a.get("5ea7ed")) == digest(b.get("5ea7ed")) == digest(first)

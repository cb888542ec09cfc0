"""Issuing a step's store copies on a thread of its own (``store_thread``), so the engine's
thread never waits for the copy call.

In ``wait_for_save`` the worker issues the step's stores on the store stream, behind an
event on the compute stream. A DMA batch of tens of thousands of copies queued behind
that step's forward can block its call until the GPU has worked through it: on an H200
(session 29, Llama-8B shape, 64 requests a batch, 256 prompt chunks of 37.7 MB stored
while they prefill) one ``wait_for_save`` in 11 of 12 storing batches took 1.64-1.67 s,
and storing batches spent 1.10 x as long before decoding as batches opting out of
stores (1.13 x in session 28), while stores on the pair kernel (one launch) added
nothing there (1.00 x). The likely reading: the engine's thread,
blocked in the call, could not prepare the next step, so the GPU idled while the copies
ran. vLLM's own DMA offloading issues its batched copies from a background thread for
the same reason.

With ``store_thread`` on, ``wait_for_save`` records the compute stream's event and queues
the batch; this thread makes the store stream wait for that event, then issues the copy
exactly as the engine's thread would have, and only then marks the stores issued. A store
is not complete before it is issued (``InflightStore.issued``), so nothing is reported,
timed, audited or written to storage before its copy has run; ``drain`` waits until every
queued batch is issued (a preemption or shutdown then synchronizes the copies). The copy
call releases the GIL while it waits in the driver (torch.ops calls do), so the engine's
thread goes on meanwhile. A batch that fails to issue fails its stores with
``store_error``, as a refused plan does.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_draft_offload.config import CopyPath
from vllm_draft_offload.transfers import PairBatch
from vllm_draft_offload.worker_stores import InflightStore

logger = logging.getLogger(__name__)


@dataclass
class StoreBatch:
    """One step's stores: their copy's pairs, and the event the copy must wait for (the
    compute stream's, recorded in ``wait_for_save``; None on CPU tensors)."""

    stores: list[InflightStore]
    pairs: PairBatch
    ready: torch.Event | None
    # The copy's route when not copy_path's ("memcpy": a decode step's, decode_stores_dma).
    path: CopyPath | None = None


class StoreIssuer:
    """A thread that issues queued store batches in order with ``issue``."""

    def __init__(self, issue: Callable[[StoreBatch], None], device: torch.device) -> None:
        self._issue = issue
        self._device = device
        self._queue: queue.Queue[StoreBatch | None] = queue.Queue()
        self._thread = threading.Thread(
            target=self._run, name="draft-offload-store-issuer", daemon=True
        )
        self._thread.start()

    def submit(self, batch: StoreBatch) -> None:
        """Queue a batch; its stores stay unissued until this thread issued its copy."""
        for store in batch.stores:
            store.issued = False
        self._queue.put(batch)

    def drain(self) -> None:
        """Wait until every batch queued so far is issued (its copy may still run)."""
        self._queue.join()

    def close(self) -> None:
        """Issue what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                self._issue_one(batch)
            finally:
                self._queue.task_done()

    def _issue_one(self, batch: StoreBatch) -> None:
        try:
            self._issue(batch)
        except Exception:
            logger.exception(
                "DraftOffloadConnector: %d store job(s) could not be issued; their units "
                "are dropped",
                len(batch.stores),
            )
            for store in batch.stores:
                store.event = None
                store.start = None
                store.keepalive = []
                store.failed_cause = "store_error"
        finally:
            # Last: the engine's thread reads the store's fields once this is set.
            for store in batch.stores:
                store.issued = True

"""The engine's prefill speed, shared through storage so a restarted engine can weigh
its first storage hits.

The L3 cost policy needs the time a prefill would take before it can decide whether
a storage hit is worth its wait (l3_cost.py). An engine learns that from its own
steps, so right after a start it knows nothing, and the prompts that storage exists
for (the first ones after a restart, with an empty CPU tier) would all recompute.
Every engine therefore writes the step samples of its prefill fit to storage, as one
small object named by the key salt (model, drafter, geometry, TP size, cache
generation) and the device name; an engine that starts with the same salt on the
same kind of device reads it at start and uses it until its own fit exists.

The object is JSON: the format version, the device, and up to WINDOW samples of
(tokens, attention, seconds). Anything unreadable is ignored (the engine then
starts without an estimate, as with no calibration at all).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from vllm_draft_offload.l3_prefill_fit import WINDOW, PrefillEstimate, Sample

if TYPE_CHECKING:
    from vllm_draft_offload.l3_lookup import SchedulerL3

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
# Hex tail of a calibration object's name. Unit objects are named by a 32-digit key
# and a 4-digit rank, 36 digits; calibration names have 40, so they never collide.
NAME_SUFFIX = "ca1bca1b"
# An engine rewrites its calibration at most this often (and once at shutdown).
SAVE_INTERVAL_S = 60.0


def device_name() -> str:
    """The accelerator's model name as vLLM's platform reports it (NVML on CUDA: the
    scheduler process never initialises CUDA for this)."""
    try:
        from vllm.platforms import current_platform

        try:
            return str(current_platform.get_device_name(0))
        except Exception:  # a platform without the query still has a kind
            return str(current_platform.device_name)
    except Exception:
        return "unknown"


def object_name(salt: bytes, device: str) -> str:
    digest = hashlib.blake2b(b"prefill-calibration/v1\0" + salt + device.encode(), digest_size=16)
    return digest.hexdigest() + NAME_SUFFIX


def is_calibration_file(file_name: str) -> bool:
    """An fs:// file holding a calibration, not a unit (LMCache names files
    `<namespace>@<world>@<worker>@<hex key>@<dtype>.data`)."""
    return f"{NAME_SUFFIX}@" in file_name


def encode(samples: list[Sample], device: str) -> bytes:
    return json.dumps(
        {"version": FORMAT_VERSION, "device": device, "samples": [list(s) for s in samples]}
    ).encode()


def decode(blob: bytes, device: str) -> list[Sample] | None:
    """The samples, or None when the object is not a calibration of this device."""
    try:
        doc = json.loads(blob)
        if doc.get("version") != FORMAT_VERSION or doc.get("device") != device:
            return None
        samples = [(float(t), float(a), float(s)) for t, a, s in doc["samples"][-WINDOW:]]
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if not all(math.isfinite(v) and v >= 0 for sample in samples for v in sample):
        return None
    return samples


class Calibration:
    """Reads the calibration once at start; writes this engine's own samples back."""

    def __init__(self, lookup: SchedulerL3, salt: bytes, timeout_s: float) -> None:
        self.lookup = lookup
        self.device = device_name()
        self.name = object_name(salt, self.device)
        self.timeout_s = timeout_s
        self._saved = 0  # PrefillEstimate.observed at the last save
        self._last_save = -math.inf
        self._saving: Future[None] | None = None

    def load_into(self, prefill: PrefillEstimate) -> bool:
        """Read the calibration (blocking, at most timeout_s: engine start) into
        `prefill`'s prior; True when one was found and makes a fit."""
        try:
            blob = self.lookup.read_object(self.name).result(self.timeout_s)
        except Exception as exc:  # storage down or slow: start without an estimate
            logger.warning("DraftOffloadConnector: reading the L3 calibration failed: %s", exc)
            return False
        samples = decode(blob, self.device) if blob is not None else None
        if blob is not None and samples is None:
            logger.warning(
                "DraftOffloadConnector: L3 calibration %s unreadable; ignored", self.name
            )
        loaded = samples is not None and prefill.set_prior(samples)
        logger.info(
            "DraftOffloadConnector: prefill calibration for %s %s",
            self.device,
            f"loaded ({len(samples or [])} steps)" if loaded else "not found in storage",
        )
        return loaded

    def _news(self, prefill: PrefillEstimate) -> bool:
        """Steps timed since the last save, and a prefill among the samples."""
        return prefill.observed > self._saved and prefill.has_prefill

    def maybe_save(self, prefill: PrefillEstimate) -> None:
        """With new samples, at most every SAVE_INTERVAL_S (the first time as soon as a
        prefill step was timed), in the background."""
        if not self._news(prefill) or (self._saving and not self._saving.done()):
            return
        if time.monotonic() - self._last_save < SAVE_INTERVAL_S:
            return
        self._saving = self._save(prefill)

    def save_now(self, prefill: PrefillEstimate) -> None:
        """At shutdown: write what this engine learnt, waiting at most timeout_s."""
        if not self._news(prefill):
            return
        try:
            self._save(prefill).result(self.timeout_s)
        except Exception as exc:
            logger.warning("DraftOffloadConnector: writing the L3 calibration failed: %s", exc)

    def _save(self, prefill: PrefillEstimate) -> Future[None]:
        self._saved = prefill.observed
        self._last_save = time.monotonic()
        return self.lookup.write_object(self.name, encode(prefill.samples_to_share(), self.device))

"""Test-wide environment: vLLM runs on the CPU platform, with no model hub."""

import os

# Must be set before vllm is imported anywhere: platform detection reads them once.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

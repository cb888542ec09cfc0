"""Draft-aware KV offloading for vLLM: target and drafter KV move as one unit."""

__version__ = "0.1.0"

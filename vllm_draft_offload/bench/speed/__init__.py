"""Speed at real KV sizes: restore TTFT, storage-tier fetches, raw disk baselines."""

"""The workload benchmark: ours vs vLLM's and LMCache's connectors on shared prompts."""

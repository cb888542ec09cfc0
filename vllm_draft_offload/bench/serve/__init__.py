"""``vllm bench serve`` against ``vllm serve`` with and without the connector, and its
``/metrics`` scrapes."""

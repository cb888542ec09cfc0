"""``vllm bench serve`` against ``vllm serve`` with and without the connector, its
``/metrics`` scrapes, and the Grafana dashboard's panels rendered from them."""

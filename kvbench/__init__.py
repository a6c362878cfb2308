"""kvbench: a benchmark harness for KV-cache eviction policies with true block-wise prompt processing."""

__version__ = "0.1.0"

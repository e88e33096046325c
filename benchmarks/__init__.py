"""Benchmarks: decode-step latency, throughput against peers, GRPO steps."""

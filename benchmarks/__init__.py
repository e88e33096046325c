"""Benchmarks of cb_sync against its peers: Workloads T (throughput), G and G2 (GRPO) and L (long rollouts)."""

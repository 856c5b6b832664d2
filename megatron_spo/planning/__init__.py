"""Capacity planning: memory, weight-sync and throughput estimates for a cluster (`megatron-spo plan`)."""

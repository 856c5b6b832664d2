"""megatron-spo: Soft Policy Optimization (SPO), AGRO and PPO post-training on megatron-core."""

__version__ = "0.1.0"

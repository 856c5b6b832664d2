"""megatron-spo: Soft Policy Optimization (SPO), AGRO and PPO post-training on megatron-core."""

from megatron_spo import deferred_compile

__version__ = "0.1.0"

deferred_compile.install()  # what megatron-core torch.compiles at import compiles at its first call

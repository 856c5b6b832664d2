"""A user-defined algorithm for tests/test_extensions.py, loaded through the config hook 'algo: module:Class'."""

from megatron_spo.training.algos.spo import SPO


class LoudSPO(SPO):
    """SPO that reports one metric of its own: proof the hooked class is the one that ran."""

    name = "loud_spo"

    def update(self, step):
        update = super().update(step)
        update.metrics["loud_spo"] = 1.0
        return update

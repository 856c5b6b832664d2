"""User code for tests/test_extensions.py and tests/test_spo_transforms.py, loaded through config hooks: an algorithm
('algo: module:Class') and an SPO coefficient transform ('sources.online.transforms: [module:function]')."""

from megatron_spo.training.algos.spo import SPO


class LoudSPO(SPO):
    """SPO that reports one metric of its own: proof the hooked class is the one that ran."""

    name = "loud_spo"

    def update(self, step):
        update = super().update(step)
        update.metrics["loud_spo"] = 1.0
        return update


def doubled_coefficient(terms):
    """An SPO coefficient transform of one's own (sources.NAME.transforms: [extension_helpers:doubled_coefficient]):
    every sequence's coefficient dL/dQ_T doubled, so its gradient is exactly twice the built-in one."""
    return terms.replace(coefficient=2 * terms.need_coefficient("doubled_coefficient"))

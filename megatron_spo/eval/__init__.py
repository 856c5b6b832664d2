"""Evaluation: the unbiased pass@k estimator (numpy only; importing this package stays light).

The evaluation runner (sampling a model on a task) lives in megatron_spo.engine_tools.eval.
"""

from megatron_spo.eval.passk import pass_at_k

__all__ = ["pass_at_k"]

"""Experiments on top of the training loop: the CPU quickstart, the algorithm study and its report, the TRL
GRPO bridge, and the quickstart reference model they start from."""

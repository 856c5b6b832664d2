"""The tools that drive inference engines: estimate-q0 (estimate_q0.py), pivotal token search (pts.py) and pass@k
evaluation (eval.py), and what they share (common.py: sampling and scoring through EngineClient and a RewardPool,
the resumable run, command-line arguments, stop signals). They read problems, prompts and Q0 files as plain data
from data/ and never import training/ (the quickstart, in training/, calls them)."""

"""The tools that drive inference engines: estimate-q0 (estimate_q0.py), pivotal token search (pts.py) and pass@k
evaluation (eval.py); sampling.py: sampling and scoring through EngineClient and a RewardPool, and the resumable
run; command_line.py: the arguments they share and run_cli (one-line errors, stop signals). They read problems,
prompts and Q0 files as plain data from data/ and never import training/ (the quickstart, in experiments/, calls
them)."""

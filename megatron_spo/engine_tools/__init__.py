"""The tools that drive inference engines: pivotal token search (pts.py) and pass@k evaluation (eval.py)."""

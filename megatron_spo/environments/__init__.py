"""Multi-turn environments (docs/multi-turn.md): what answers the model between its turns, one object per
conversation, driven by the rollout manager (rollout/manager.py). Built in: code_feedback (code_feedback.py) and
calculator (calculator.py); a user's own is a hook 'package.module:name' (rollout.env.name). base.py: the contract,
loading and checking, and the bounds on observation text."""

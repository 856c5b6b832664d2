"""A reward of your own, named in the training config (no edit to megatron-spo):

    task:
      kind: toy
      reward: examples.custom_reward:fenced_code     # 'package.module:function', importable from the run's cwd

It receives the problem (id, prompt, tests, ...) and the completion text and returns a float: 0 is success and
-1 failure in the SPO paper's convention; values in between are partial credit. It runs in a worker thread, so
it may block. This one is a format reward: credit for answering with one fenced Python block, more for a short one.
"""

import re

FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


def fenced_code(problem, completion: str) -> float:
    blocks = FENCE.findall(completion)
    if len(blocks) != 1:
        return -1.0
    return -0.5 * min(1.0, len(blocks[0]) / 400)  # -0.5 .. 0: shorter programs score higher

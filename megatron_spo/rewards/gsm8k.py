"""GSM8K's answer convention: the final answer is the number after '####' (the dataset's own solutions end with
'#### 42', and verl's GSM8K prompt asks the model to answer so).

    gsm8k_answer("... so 6 * 7 = 42.\\n#### 42")    # '42'
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def gsm8k_answer(text: str) -> str | None:
    """The number after the last '####' (thousands commas removed); None when there is none."""
    found = _ANSWER.findall(text)
    return found[-1].replace(",", "") if found else None

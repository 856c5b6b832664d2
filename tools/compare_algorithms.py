"""SPO vs PPO vs AGRO vs GRPO vs TRL's GRPO on the quickstart task: `megatron-spo compare`, from a checkout.

    python tools/compare_algorithms.py [out_dir=outputs/compare] [seeds=[0,1,2]] [quickstart.train.steps=90 ...]

The study (equal-budget sweep on a validation split, seeded runs, long runs, report.md + PNGs) lives in
megatron_spo/experiments/study.py; this file only runs it.
"""

import sys

from megatron_spo.experiments.study import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

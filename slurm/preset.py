"""The launch parameters of a model preset, for slurm/submit.sh: prints "ENGINE_TP DEFAULT_CONFIG".

    python3 slurm/preset.py qwen3-32b        # -> "4 " (no example training config for it)

ENGINE_TP: the smallest power of two of GPUs whose share of the bf16 weights is at most 40% of an 80 GB GPU
(the rest is KV cache): 1 for 7-8B, 4 for 32B, 8 for 70B. DEFAULT_CONFIG: examples/<preset>-spo.yaml if any.
A preset the registry (planning/capacity.py and examples/models/) does not know: one line, exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

WEIGHT_SHARE_GB = 0.4 * 80


def engine_tp(parameters: int) -> int:
    tp = 1
    while parameters * 2 / 1e9 / tp > WEIGHT_SHARE_GB and tp < 8:
        tp *= 2
    return tp


def main(argv: list[str]) -> int:
    from megatron_spo.config import ConfigError
    from megatron_spo.planning.capacity import load_preset, stage_parameters

    try:
        model, _ = load_preset(argv[0])
    except ConfigError as err:
        print(f"submit.sh: --preset: {str(err).removeprefix('plan: ')}", file=sys.stderr)
        return 2
    example = Path(__file__).resolve().parents[1] / "examples" / f"{argv[0]}-spo.yaml"
    print(engine_tp(stage_parameters(model, 1, 1)), example if example.is_file() else "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What slurm/spo.sbatch adds for a training config with LoRA adapter pushes: the engines' LoRA flags and the
trainer's overrides (on the training floor: it reads a TrainConfig; the flags come from rollout/adapter_push.py).

    python -m megatron_spo.training.slurm_lora slurm-args CONFIG [KEY=VALUE ...]
"""
from __future__ import annotations

from megatron_spo.config import ConfigError
from megatron_spo.rollout.adapter_push import engine_lora_args


def slurm_lora_launch(cfg) -> tuple[list[str], list[str]]:
    """(engine flags, trainer overrides) slurm/spo.sbatch adds for a training config with LoRA adapter pushes: the
    engines start with its LoRA shape (engine_lora_args), and lora.transport=auto becomes path (the job's run
    directory, where lora.push_dir defaults, is on a filesystem every node of the job shares). ([], []) without
    LoRA or with lora.push=merged; an explicit lora.transport is left as it is."""
    from megatron_spo.models.hf_checkpoint import read_hf_config

    lora = cfg.lora
    if lora is None or lora.push == "merged":
        return [], []
    if cfg.model is None and not cfg.init.hf:
        raise ConfigError("init.hf: the engines' LoRA flags need the model's layers (init.hf or model)")
    model_cfg = cfg.model or read_hf_config(cfg.init.hf)
    return engine_lora_args(lora, model_cfg), (["lora.transport=path"] if lora.transport == "auto" else [])


def main(argv: list[str]) -> int:
    """python -m megatron_spo.training.slurm_lora slurm-args CONFIG [KEY=VALUE ...]: two lines, the engines' LoRA
    flags and the trainer's added overrides, each shell-quoted (empty lines without LoRA); a bad config: one line
    on stderr, exit 2."""
    import shlex
    import sys

    from megatron_spo.config import load_config
    from megatron_spo.training.config import TrainConfig

    if len(argv) < 2 or argv[0] != "slurm-args":
        print("usage: python -m megatron_spo.training.slurm_lora slurm-args CONFIG [KEY=VALUE ...]", file=sys.stderr)
        return 2
    try:
        engine, train = slurm_lora_launch(load_config(TrainConfig, argv[1], argv[2:]))
    except (ConfigError, OSError, ValueError) as err:
        print(f"spo.sbatch: LoRA engine flags: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    print(shlex.join(engine))
    print(shlex.join(train))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))

"""What slurm/spo.sbatch adds for a training config: the engines' flags (LoRA adapter pushes; rollout routing replay of
a mixture-of-experts model) and the trainer's overrides (on the training floor: it reads a TrainConfig; the LoRA flags
come from rollout/adapter_push.py).

    python -m megatron_spo.training.slurm_args [--mode gpu|cpu] [--engine-tp N] CONFIG [KEY=VALUE ...]
"""
from __future__ import annotations

from megatron_spo.config import ConfigError
from megatron_spo.rollout.adapter_push import engine_lora_args


def _model(cfg, flags: str):
    """The policy's ModelConfig (cfg.model, else init.hf's config.json); ConfigError when neither is set."""
    from megatron_spo.models.hf_checkpoint import read_hf_config

    if cfg.model is None and not cfg.init.hf:
        raise ConfigError(f"init.hf: {flags} need the model's layers (init.hf or model)")
    return cfg.model or read_hf_config(cfg.init.hf)


def slurm_lora_launch(cfg) -> tuple[list[str], list[str]]:
    """(engine flags, trainer overrides) slurm/spo.sbatch adds for a training config with LoRA adapter pushes: the
    engines start with its LoRA shape (engine_lora_args), and lora.transport=auto becomes path (the job's run
    directory, where lora.push_dir defaults, is on a filesystem every node of the job shares). ([], []) without
    LoRA or with lora.push=merged; an explicit lora.transport is left as it is."""
    lora = cfg.lora
    if lora is None or lora.push == "merged":
        return [], []
    return (engine_lora_args(lora, _model(cfg, "the engines' LoRA flags")),
            ["lora.transport=path"] if lora.transport == "auto" else [])


def engine_routing_args(cfg, *, mode: str = "gpu", engine_tp: int = 1) -> list[str]:
    """The engines' flags of a run whose trainer asks every rollout for its routes (routing_replay: engine on a
    mixture-of-experts model, training/online.py replayed_top_k): --enable-return-routed-experts (SGLang's flag, and
    megatron-spo serve's); on GPUs (mode gpu: SGLang) at engine_tp > 1 also --ep-size engine_tp where the experts
    split evenly, SGLang's expert parallelism (it needs ep_size = tp_size): each GPU holds E / TP whole experts, not a
    1 / TP slice of every expert, and the routes it returns are the router's expert ids either way. [] otherwise."""
    model = _model(cfg, "the engines' routed-experts flag") if cfg.routing_replay == "engine" else None
    if model is None or model.moe is None:
        return []
    flags = ["--enable-return-routed-experts"]
    if mode == "gpu" and engine_tp > 1 and model.moe.num_experts % engine_tp == 0:
        flags += ["--ep-size", str(engine_tp)]
    return flags


def main(argv: list[str]) -> int:
    """Three lines, each shell-quoted (empty where nothing is added): the engines' LoRA flags, their routed-experts
    flags, the trainer's added overrides. A bad config: one line on stderr, exit 2."""
    import argparse
    import shlex
    import sys

    from megatron_spo.config import load_config
    from megatron_spo.training.config import TrainConfig

    parser = argparse.ArgumentParser(prog="python -m megatron_spo.training.slurm_args",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("config", help="training YAML config")
    parser.add_argument("overrides", nargs="*", help="the trainer's KEY=VALUE arguments")
    parser.add_argument("--mode", choices=("gpu", "cpu"), default="gpu",
                        help="gpu: SGLang engines; cpu: megatron-spo serve (spo.sbatch's MODE)")
    parser.add_argument("--engine-tp", type=int, default=1, help="GPUs per engine (spo.sbatch's ENGINE_TP)")
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_config(TrainConfig, args.config, args.overrides)
        lora, train = slurm_lora_launch(cfg)
        routing = engine_routing_args(cfg, mode=args.mode, engine_tp=args.engine_tp)
    except (ConfigError, OSError, ValueError) as err:
        print(f"spo.sbatch: engine flags: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    print(shlex.join(lora))
    print(shlex.join(routing))
    print(shlex.join(train))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))

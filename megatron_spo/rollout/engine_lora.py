"""LoRA adapters served by the local engine, with SGLang's rules (sglang 0.5.23, srt/lora/): the engine is started
with LoRA's shape fixed (--enable-lora --max-lora-rank --lora-target-modules), adapters are loaded from tensors under
a name and unloaded by name, a loaded name cannot be loaded again, and a request picks one with ``lora_path`` (None:
the base model). An adapter's module y = W x + (alpha / r) * B A x, alpha and r from its config_dict (use_rslora is
ignored, as SGLang does); lora_A [r, in], lora_B [out, r] in HF PEFT names
(``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``).

    lora = EngineLora(model, max_rank=16, target_modules=["q_proj", "v_proj"])   # hooks the target linears
    lora.load("policy-v3-ab12", config_dict, tensors)
    with lora.active("policy-v3-ab12"):        # one adapter per forward batch (the scheduler batches by adapter)
        logits = model(...)
"""

from __future__ import annotations

import contextlib
import re

import torch

from megatron_spo.rollout.adapter_push import NORMALIZED

SUPPORTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:base_model\.model\.)?(model\.layers\.\d+\.\w+\.(\w+))\.lora_([AB])\.weight")


class _Delta:
    """A forward hook on a target nn.Linear adding the active adapter's delta (none active: the output untouched;
    the model's parameter names stay the base's, so full-weight pushes still find them)."""

    def __init__(self, base: torch.nn.Linear):
        self.base = base
        self.delta: tuple[torch.Tensor, torch.Tensor, float] | None = None
        base.register_forward_hook(self)

    def __call__(self, module, inputs, out):
        if self.delta is None:
            return out
        a, b, scaling = self.delta
        return out + scaling * torch.nn.functional.linear(torch.nn.functional.linear(inputs[0], a), b)


def read_peft_dir(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """An HF PEFT directory as SGLang reads one for /load_lora_adapter: adapter_config.json (LoRAConfig) and the
    tensors of every *.safetensors in it (DefaultModelLoader's weight iterator); its digest manifest (digests.json,
    when present) checked first."""
    import json
    import os

    from safetensors.torch import load_file

    from megatron_spo.checkpoint_digest import verify_checkpoint

    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise ValueError(f"LoRA adapter path {path} is not a directory with adapter_config.json (is it on a "
                         "filesystem this engine shares with the trainer?)")
    verify_checkpoint(path)
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not shards:
        raise ValueError(f"LoRA adapter path {path} holds no *.safetensors")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(os.path.join(path, shard)))
    return config, tensors


class EngineLora:
    """The adapters one engine holds, on the target linears of its HF model."""

    def __init__(self, model: torch.nn.Module, *, max_rank: int, target_modules: list[str]):
        if max_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {max_rank}")
        unknown = [m for m in target_modules if m not in SUPPORTED and m != "all"]
        if unknown:
            raise ValueError(f"--lora-target-modules: {unknown[0]!r} is not one of {', '.join(SUPPORTED)}, all")
        self.max_rank = max_rank
        self.target_modules = sorted(SUPPORTED if "all" in target_modules else set(target_modules))
        self.modules: dict[str, _Delta] = {}  # "model.layers.{i}.self_attn.q_proj" -> its hook
        for name, module in model.named_modules():
            if name.split(".")[-1] in self.target_modules and isinstance(module, torch.nn.Linear):
                self.modules[name] = _Delta(module)
        # name -> {module path: (A, B, scaling)}
        self.adapters: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = {}

    def load(self, name: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Check everything, then add the adapter (a refused one changes nothing). ValueError with SGLang's
        text where SGLang has one."""
        if name in self.adapters:
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
        if not isinstance(config, dict) or not {"r", "lora_alpha", "target_modules"} <= set(config):
            raise ValueError(f"LoRA adapter {name}: config_dict needs r, lora_alpha and target_modules")
        rank, targets = int(config["r"]), config["target_modules"]
        targets = self.target_modules if targets in ("all", "all-linear") else targets
        served = {NORMALIZED.get(m, m) for m in self.target_modules}
        if rank > self.max_rank or not {NORMALIZED.get(m, m) for m in targets} <= served:
            raise ValueError(f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory "
                             "pool configuration. Please ensure that the LoRA adapter's rank is within the configured "
                             "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
        if config.get("use_dora"):
            raise ValueError(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
        factors: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            m = _KEY.fullmatch(key)
            if m is None:
                raise ValueError(f"LoRA adapter {name}: {key!r} is not an HF PEFT lora_A / lora_B name")
            path, module, factor = m.groups()
            if module not in targets:
                continue  # SGLang skips weights of modules outside the adapter's target_modules
            if path not in self.modules:
                raise ValueError(f"LoRA adapter {name}: {key} names no module of this model (an adapter of another "
                                 "base?)")
            factors.setdefault(path, {})[factor] = tensor
        scaling = float(config["lora_alpha"]) / rank
        deltas = {}
        for path, pair in sorted(factors.items()):
            if set(pair) != {"A", "B"}:
                raise ValueError(f"LoRA adapter {name}: {path} has lora_{''.join(pair)} but not both factors")
            base = self.modules[path].base
            want = {"A": (rank, base.in_features), "B": (base.out_features, rank)}
            for factor, shape in want.items():
                if tuple(pair[factor].shape) != shape:
                    raise ValueError(f"LoRA adapter {name}: {path}.lora_{factor} has shape "
                                     f"{list(pair[factor].shape)}, this model's {path} takes {list(shape)} (an adapter "
                                     "of another base, or a rank that is not config_dict's r)")
            dtype, device = base.weight.dtype, base.weight.device
            deltas[path] = (pair["A"].to(device, dtype).contiguous(), pair["B"].to(device, dtype).contiguous(), scaling)
        self.adapters[name] = deltas

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}")
        del self.adapters[name]

    def check_request(self, name: str | None) -> None:
        if name is not None and name not in self.adapters:
            raise ValueError(f"The following requested LoRA adapters are not loaded: {name}\n"
                             f"Loaded adapters: {list(self.adapters)}.")

    @contextlib.contextmanager
    def active(self, name: str | None):
        """Inside, the model computes with adapter ``name`` (None: the base)."""
        deltas = {} if name is None else self.adapters[name]
        for path, module in self.modules.items():
            module.delta = deltas.get(path)
        try:
            yield
        finally:
            for module in self.modules.values():
                module.delta = None

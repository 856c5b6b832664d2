"""LoRA adapters as an HF PEFT directory: adapter_config.json + adapter_model.safetensors that
peft.PeftModel.from_pretrained (and SGLang's /load_lora_adapter) loads, named through the family's rule table.

    write_peft_adapter(out_dir, gather_adapters(policy), lora_cfg, model_cfg, base_model="/models/Llama-3.1-8B")
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_spo.models.hf_map import from_megatron, hf_names, layer_rules
from megatron_spo.models.lora import TARGET_PATHS, LoraConfig, split_of

PEFT_PREFIX = "base_model.model."


def peft_tensors(adapters: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
    """Full adapters (gather_adapters' keys) -> HF PEFT names, through the family's rule table (models/hf_map.py):
    a fused linear's B is split like its weight (linear_qkv into q / k / v, linear_fc1 into gate / up), each part
    keeping the shared A (q = W_q x + s B_q A x). lora_A [r, in], lora_B [out, r]."""
    rules = {r.megatron: r for r in layer_rules(model_cfg)}
    out: dict[str, torch.Tensor] = {}
    for key in sorted(k for k in adapters if k.endswith(".lora_A")):
        layer, target = int(key.split(".")[2]), split_of(key)[0]
        rule = rules[f"{TARGET_PATHS[target]}.weight"]
        a, b = adapters[key], adapters[key[: -len("lora_A")] + "lora_B"]
        for name, part in zip(hf_names(rule, layer), from_megatron(rule, b, model_cfg)):
            module = PEFT_PREFIX + name.removesuffix(".weight")
            out[f"{module}.lora_A.weight"] = a.clone()  # its own storage: safetensors refuses shared ones
            out[f"{module}.lora_B.weight"] = part.contiguous()
    return out


def peft_config(lora: LoraConfig, model_cfg, base_model: str | None = None) -> dict:
    """adapter_config.json of the adapters: target_modules are the HF module names the targets map to."""
    modules = sorted({name.split(".")[-2] for r in layer_rules(model_cfg)
                      for t in lora.targets if r.megatron == f"{TARGET_PATHS[t]}.weight" for name in r.hf})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "use_rslora": lora.rslora, "target_modules": modules, "bias": "none",
            "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": base_model}


def write_peft_adapter(out_dir: str | Path, adapters: dict[str, torch.Tensor], lora: LoraConfig, model_cfg,
                       base_model: str | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Write the adapters as an HF PEFT directory (atomically: out_dir appears complete or not at all), with the
    digest manifest every export carries."""
    tensors = {k: v.to(dtype) for k, v in peft_tensors(adapters, model_cfg).items()}
    return write_peft_dir(out_dir, tensors, peft_config(lora, model_cfg, base_model))


def write_peft_dir(out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """An HF PEFT directory from tensors already in PEFT names and their adapter_config.json: written under
    out_dir.partial with the digest manifest, then renamed (out_dir appears complete or not at all)."""
    import os
    import shutil

    from safetensors.torch import save_file

    from megatron_spo.checkpoint_digest import write_manifest

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_manifest(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out

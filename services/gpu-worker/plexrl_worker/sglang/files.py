"""What SGLang loads from disk: PEFT-format LoRA adapters and full weights as safetensors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

PEFT_PREFIX = "base_model.model."
_MODEL_FILES = ("config.json", "generation_config.json")


def write_lora_adapter(
    directory: Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    rank: int,
    alpha: float,
    base_model: str = "",
) -> Path:
    """Write a PEFT adapter (adapter_config.json + adapter_model.safetensors) that SGLang's
    /load_lora_adapter reads.

    `tensors` are named as the torch engine names an adapter's parameters
    (`model.layers.0.self_attn.q_proj.lora_A.weight`), with or without PEFT's
    `base_model.model.` prefix; the target modules are read off the names.
    """
    if not tensors:
        raise ValueError("an adapter needs at least one lora_A / lora_B tensor")
    targets: set[str] = set()
    named: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        key = name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name
        parts = key.split(".")
        if len(parts) < 3 or parts[-2] not in ("lora_A", "lora_B") or parts[-1] != "weight":
            raise ValueError(f"{name!r} is not a LoRA weight (want ...<module>.lora_A.weight)")
        targets.add(parts[-3])
        named[key] = tensor.detach().to("cpu").contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "base_model_name_or_path": base_model,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(named, str(directory / "adapter_model.safetensors"))
    return directory


def write_full_weights(
    directory: Path, tensors: Mapping[str, torch.Tensor], *, base_model_dir: Path
) -> Path:
    """Write full model weights where SGLang's /update_weights_from_disk can read them:
    the base model's config files beside one model.safetensors."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in _MODEL_FILES:
        if (base_model_dir / name).exists():
            shutil.copyfile(base_model_dir / name, directory / name)
    # safetensors refuses tensors that share storage (tied embeddings): clone them.
    named = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(named, str(directory / "model.safetensors"))
    return directory

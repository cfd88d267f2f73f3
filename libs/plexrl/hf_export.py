"""A job's trained weights as Hugging Face files: {file name: bytes}.

- A LoRA job becomes a PEFT adapter directory: `adapter_config.json` and
  `adapter_model.safetensors`, which `peft.PeftModel.from_pretrained(base, dir)` and
  SGLang's LoRA loader read over the base model. Tensor names are PEFT's saved form
  (`base_model.model.<module>.lora_A.weight`, no adapter name); the config says what
  the engine trained with: rank, alpha (scaling alpha / r), no dropout, no bias.
- A full fine-tune becomes a model directory that `AutoModelForCausalLM.from_pretrained`
  loads standalone: `model.safetensors` with the model's own parameter names, the base
  model's `config.json` (its dtype set to the weights' dtype), and the base model's
  generation config and tokenizer files.

The conversion is pure: weights in, bytes out. The one read of the disk,
`base_model_files`, is separate, so the worker runs it beside the conversion off its
event loop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from plexrl.messages import JobSpec, LoraSpec
from plexrl.models import BaseModelInfo

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MODEL_CONFIG = "config.json"
MODEL_WEIGHTS = "model.safetensors"

PEFT_PREFIX = "base_model.model."
"""What PEFT's saved adapter names start with: the model under PeftModel's wrappers."""

_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")

# Files of a model directory that are weights (or their index), or PlexRL's own notes:
# never copied from the base into a full fine-tune's export.
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
_NOT_COPIED_NAMES = frozenset({"plexrl.json"})
_COPIED_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")


class ExportError(ValueError):
    """The weights do not fit the export asked for (says what does not)."""


def export_files(
    weights: dict[str, torch.Tensor],
    spec: JobSpec,
    info: BaseModelInfo,
    base_files: dict[str, bytes] | None = None,
) -> dict[str, bytes]:
    """The job's Hugging Face files, in the order they are stored. `weights` are the
    job's trainable parameters by their engine names (the job state's `weights.` keys
    without the prefix); `base_files` (`base_model_files`) are needed for a full
    fine-tune."""
    if spec.lora is not None:
        return lora_adapter(weights, spec.lora, spec.base_model, info)
    if base_files is None:
        raise ExportError("a full fine-tune's export needs the base model's config files")
    return full_model(weights, base_files)


def lora_adapter(
    weights: dict[str, torch.Tensor], lora: LoraSpec, base_model: str, info: BaseModelInfo
) -> dict[str, bytes]:
    """A PEFT adapter directory's files for LoRA weights named like
    `model.layers.0.self_attn.q_proj.lora_A.weight`."""
    modules: set[str] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if not name.endswith(_LORA_SUFFIXES):
            raise ExportError(f"{name!r} is not a LoRA weight (lora_A or lora_B of a module)")
        modules.add(name.rsplit(".", 2)[0])
        tensors[PEFT_PREFIX + name] = _plain(tensor)
    if not modules:
        raise ExportError("the job has no LoRA weights to export")
    config = adapter_config(lora, base_model, target_modules(modules, info))
    return {
        ADAPTER_CONFIG: _json_bytes(config),
        ADAPTER_WEIGHTS: st_save(tensors, metadata={"format": "pt"}),
    }


def target_modules(modules: set[str], info: BaseModelInfo) -> list[str]:
    """`target_modules` for an adapter of these modules: their short names (`q_proj`)
    when those name exactly these modules of the model, which is what SGLang's loader
    reads; the full module paths otherwise (PEFT matches either)."""
    short = {m.rpartition(".")[2] for m in modules}
    named = {lin.module for lin in info.linears if lin.module.rpartition(".")[2] in short}
    return sorted(short) if named == modules else sorted(modules)


def adapter_config(lora: LoraSpec, base_model: str, targets: list[str]) -> dict[str, Any]:
    """PEFT's LoraConfig as saved: what the engine's adapters are (`SharedBase`)."""
    alpha: float = lora.alpha if lora.alpha is not None else lora.rank
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": targets,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def full_model(weights: dict[str, torch.Tensor], base_files: dict[str, bytes]) -> dict[str, bytes]:
    """A model directory's files: the weights under their model names (one tied to
    another is absent, as the model's own `named_parameters` leaves it), the base's
    config with the weights' dtype, and the base's other files as they are."""
    if MODEL_CONFIG not in base_files:
        raise ExportError(f"the base model's files have no {MODEL_CONFIG}")
    if not weights:
        raise ExportError("the job has no weights to export")
    dtypes = {t.dtype for t in weights.values()}
    config = json.loads(base_files[MODEL_CONFIG])
    if len(dtypes) == 1:
        dtype = str(next(iter(dtypes))).removeprefix("torch.")
        config["dtype"] = dtype
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype
    tensors = {name: _plain(t) for name, t in weights.items()}
    out = {MODEL_CONFIG: _json_bytes(config)}
    out[MODEL_WEIGHTS] = st_save(tensors, metadata={"format": "pt"})
    out.update((name, data) for name, data in sorted(base_files.items()) if name != MODEL_CONFIG)
    return out


def base_model_files(model_dir: Path) -> dict[str, bytes]:
    """The base model's config, generation config and tokenizer files (every top-level
    JSON, template, vocabulary or tokenizer model file), not its weights."""
    out: dict[str, bytes] = {}
    for path in sorted(model_dir.iterdir()):
        name = path.name
        if (
            not path.is_file()
            or name.startswith(".")
            or name in _NOT_COPIED_NAMES
            or name.endswith(_NOT_COPIED_SUFFIXES)
            or not name.endswith(_COPIED_SUFFIXES)
        ):
            continue
        out[name] = path.read_bytes()
    return out


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor (the job state's are copies already, each its own)."""
    return t.detach().to("cpu").contiguous()


def _json_bytes(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()

"""A job's trainable weights: LoRA adapters in a base model shared by every job on it,
or a full copy of the model. Both answer the same three questions: which module to run,
which parameters train (under stable names), and how to let go of them."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import torch
from peft import LoraConfig
from peft.functional import delete_adapter, inject_adapter_in_model, set_adapter
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.initialization import no_init_weights

from plexrl.messages import LoraSpec
from plexrl.models import BaseModelInfo
from plexrl_worker.engine.config import EngineConfig
from plexrl_worker.engine.errors import EngineInputError
from plexrl_worker.engine.state import NamedParams


def load_model(path: Path, config: EngineConfig) -> nn.Module:
    """A pretrained model on the engine's device, in eval mode (no dropout: deterministic)."""
    model: nn.Module = AutoModelForCausalLM.from_pretrained(
        path, dtype=config.torch_dtype, attn_implementation=config.attn_implementation
    )
    return model.to(config.torch_device).eval()


def empty_model(path: Path, config: EngineConfig) -> nn.Module:
    """The model's modules with uninitialised weights, for a state about to be copied in."""
    hf_config = AutoConfig.from_pretrained(path, attn_implementation=config.attn_implementation)
    # Skipping random init saves its cost; buffers (rotary tables) are still computed.
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=config.torch_dtype)
    return model.to(config.torch_device).eval()


class SharedBase:
    """A base model loaded once per worker, with every resident LoRA job's adapter in it.

    Only one adapter is active at a time (the model is shared mutable state: the engine
    serialises calls). Adapters live in numbered slots, never named after job ids,
    which may hold characters a module name cannot.
    """

    def __init__(self, info: BaseModelInfo, model: nn.Module) -> None:
        self.info = info
        self.model = model
        for p in model.parameters():
            p.requires_grad_(False)
        self._slot_ids = itertools.count()
        self._active: str | None = None

    def add_adapter(self, lora: LoraSpec, seed: int) -> str:
        """A new adapter, initialised from `seed` alone: the same spec gives bit-identical
        adapters on any worker, whatever else the base holds."""
        if lora.rank < 1:
            raise EngineInputError(f"LoRA rank is {lora.rank}; use a rank of 1 or more")
        targets = self.info.lora_targets(
            attn=lora.train_attn, mlp=lora.train_mlp, unembed=lora.train_unembed
        )
        if not targets:
            raise EngineInputError(
                "this LoRA adapts no layer; set at least one of "
                "train_attn, train_mlp, train_unembed"
            )
        slot = f"plexrl_{next(self._slot_ids)}"
        config = LoraConfig(
            r=lora.rank,
            # peft annotates an int, but scales by alpha / r in floats: a float alpha works.
            lora_alpha=cast(int, lora.alpha if lora.alpha is not None else lora.rank),
            target_modules=targets,
            lora_dropout=0.0,
            bias="none",
        )
        # peft initialises new adapter weights on the CPU from the global RNG, in module
        # order; a forked, seeded RNG makes that a function of the seed only.
        with torch.random.fork_rng(devices=[]), _quiet_peft():
            torch.manual_seed(seed)
            inject_adapter_in_model(config, self.model, adapter_name=slot)
        self._active = None  # injecting activates the new adapter; force the next switch
        return slot

    def remove_adapter(self, slot: str) -> None:
        with _quiet_peft():
            delete_adapter(self.model, slot, prefix="lora_")
        peft_configs = getattr(self.model, "peft_config", None)
        if isinstance(peft_configs, dict):
            peft_configs.pop(slot, None)  # peft leaves it behind; it would pile up
        self._active = None

    def activate(self, slot: str | None) -> nn.Module:
        """The model with only `slot`'s adapter in effect (None: the bare base model)."""
        if slot != self._active:
            set_adapter(self.model, [] if slot is None else slot)
            self._active = slot
        return self.model

    def adapter_params(self, slot: str) -> NamedParams:
        """The slot's parameters, named as if the slot did not exist
        (`model.layers.0.self_attn.q_proj.lora_A.weight`)."""
        out: list[tuple[str, nn.Parameter]] = []
        for name, p in self.model.named_parameters():
            parts = name.split(".")
            for i in range(1, len(parts)):
                if parts[i] == slot and parts[i - 1].startswith("lora_"):
                    out.append((".".join(parts[:i] + parts[i + 1 :]), p))
                    break
        return out


class LoraWeights:
    """One job's adapter in a SharedBase."""

    def __init__(self, base: SharedBase, slot: str) -> None:
        self.base = base
        self.slot = slot
        self._params = base.adapter_params(slot)

    def module(self) -> nn.Module:
        return self.base.activate(self.slot)

    def params(self) -> NamedParams:
        return self._params

    def release(self) -> None:
        self.base.remove_adapter(self.slot)
        self._params = []


class FullWeights:
    """A job's own copy of every weight (full fine-tuning)."""

    def __init__(self, model: nn.Module) -> None:
        self._model: nn.Module | None = model
        for p in model.parameters():
            p.requires_grad_(True)
        self._params: NamedParams = list(model.named_parameters())

    def module(self) -> nn.Module:
        if self._model is None:
            raise RuntimeError("these weights were released")
        return self._model

    def params(self) -> NamedParams:
        return self._params

    def release(self) -> None:
        # Dropping the last references frees the memory (the job's copy is its own).
        self._model = None
        self._params = []


Weights = LoraWeights | FullWeights


@contextmanager
def _quiet_peft() -> Iterator[None]:
    # Several adapters in one model is the point here, not a mistake peft should warn of.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*peft_config.*multiple adapters")
        warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
        yield

"""The base models one engine serves: registry lookups, each base loaded once and
shared (by every LoRA job on it and by base-model sampling), and token decoders."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transformers import AutoTokenizer

from plexrl.models import BaseModelInfo, ModelRegistry, UnknownModelError
from plexrl_worker.engine.config import EngineConfig
from plexrl_worker.engine.errors import NotFoundError
from plexrl_worker.engine.weights import SharedBase, load_model


class BaseModels:
    def __init__(self, registry: ModelRegistry, config: EngineConfig) -> None:
        self._registry = registry
        self._config = config
        self._bases: dict[Path, SharedBase] = {}
        self._decoders: dict[Path, Callable[[list[int]], str]] = {}

    def info(self, name: str) -> BaseModelInfo:
        """What the registry says of a base model (NotFoundError for one it lacks)."""
        try:
            return self._registry.info(name)
        except UnknownModelError as exc:
            raise NotFoundError(str(exc)) from exc

    def shared(self, info: BaseModelInfo) -> SharedBase:
        """The base loaded in this engine (loaded now if it was not)."""
        base = self._bases.get(info.path)
        if base is None:
            base = self._bases[info.path] = SharedBase(info, load_model(info.path, self._config))
        return base

    def loaded(self) -> list[str]:
        """Base models in memory; no lock (introspection)."""
        return sorted(base.info.name for base in list(self._bases.values()))

    def decoder(self, path: Path) -> Callable[[list[int]], str]:
        """Token ids to text with the model's tokenizer (stop strings need it)."""
        decode = self._decoders.get(path)
        if decode is None:
            tokenizer = AutoTokenizer.from_pretrained(path)

            def decode(ids: list[int]) -> str:
                return str(tokenizer.decode(ids, skip_special_tokens=False))

            self._decoders[path] = decode
        return decode

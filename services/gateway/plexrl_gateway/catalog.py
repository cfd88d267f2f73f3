"""Base models the gateway can name, described off the event loop."""

from __future__ import annotations

import asyncio

from plexrl.models import BaseModelInfo, ModelRegistry, UnknownModelError
from plexrl_gateway.errors import bad_request
from plexrl_gateway.translate import ModelLimits


class ModelCatalog:
    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry
        # A model directory does not change under a running cluster; describe it once.
        self._info: dict[str, BaseModelInfo] = {}

    async def names(self) -> list[str]:
        """Every name a client may create a model with: canonical names and aliases (an
        alias such as `Qwen/Qwen3-8B` is how a recipe's own model table finds the model)."""
        return await asyncio.to_thread(self._registry.names)

    async def info(self, name: str) -> BaseModelInfo:
        """A model's description; 400 naming the available models when it is unknown."""
        cached = self._info.get(name)
        if cached is not None:
            return cached
        try:
            info = await asyncio.to_thread(self._registry.info, name)
        except UnknownModelError as exc:
            raise bad_request(str(exc)) from None
        self._info[name] = info
        return info

    async def limits(self, name: str) -> ModelLimits:
        info = await self.info(name)
        return ModelLimits(vocab_size=info.vocab_size, max_positions=info.max_positions)

"""A cheaper `__init__` for the policy's frozen dataclasses.

`dataclass(frozen=True)` sets each field through `object.__setattr__` (the class forbids
`self.x = ...`), about three times the cost of filling the instance's `__dict__`. The
snapshot and action types are built millions of times a simulated run (a `JobView`,
`WorkerView`, `ClusterSnapshot` and `Run` per decision), so `quick_init` gives them an
`__init__` that fills `__dict__` directly. Nothing else changes: the same parameters in
the same order, the same defaults and default factories, still frozen, hashed and
compared by the dataclass's own methods.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

_C = TypeVar("_C", bound=type)


class _Factory:
    """Marks a parameter left to its default factory."""

    def __repr__(self) -> str:
        return "<factory>"  # as the dataclass's own marker shows in a signature


_FACTORY = _Factory()


def quick_init(cls: _C) -> _C:
    """Replace the frozen dataclass `cls`'s `__init__` by one that fills `__dict__`.

    Only for plain frozen dataclasses: no `__post_init__`, `InitVar`, keyword-only or
    `init=False` field and no `__slots__` (raises TypeError naming what to drop)."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"quick_init: {cls.__name__} is not a frozen dataclass")
    if hasattr(cls, "__post_init__") or "__slots__" in cls.__dict__:
        raise TypeError(f"quick_init: {cls.__name__} has __post_init__ or __slots__; leave it be")
    namespace: dict[str, Any] = {"_FACTORY": _FACTORY}
    args: list[str] = []
    body = ["    _d_ = self.__dict__"]
    for f in dataclasses.fields(cls):
        if not f.init or f.kw_only:
            raise TypeError(f"quick_init: {cls.__name__}.{f.name} is init=False or kw_only")
        name = f.name
        if f.default is not dataclasses.MISSING:
            namespace[f"_default_{name}"] = f.default
            args.append(f"{name}=_default_{name}")
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f"_factory_{name}"] = f.default_factory
            args.append(f"{name}=_FACTORY")
            body.append(f"    if {name} is _FACTORY:\n        {name} = _factory_{name}()")
        else:
            args.append(name)
        body.append(f"    _d_[{name!r}] = {name}")
    source = f"def __init__(self, {', '.join(args)}) -> None:\n" + "\n".join(body) + "\n"
    exec(source, namespace)  # built from the class's own field names, as dataclasses does
    init = namespace["__init__"]
    generated = cls.__dict__["__init__"]  # the dataclass's own
    init.__qualname__ = generated.__qualname__
    init.__module__ = cls.__module__
    init.__annotations__ = dict(generated.__annotations__)
    type.__setattr__(cls, "__init__", init)
    return cls

"""The costs of sharing the plexrl policy predicts with, learned from the workers: each
worker measures what sharing costs on its own calls (`plexrl_worker.sharing`, carried by
its heartbeat as `SharingMeasured`), and once the pool's workers together measured a
cost often enough, their mean replaces the setting's (`PLEXRL_SHARING_*`, assumptions
for a GPU by default). A worker that measured its own costs often enough, and apart
from the pool's (another engine, device or model size), has its group predicted with
its own (`WorkerView.sharing`). Pure functions, and the scheduler's running choice."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from plexrl.messages import SharingMeasured
from plexrl.policy.costs import MAX_TAIL_SHARE, SharingCosts

_SWITCH_MOVED = 0.1
"""How far a learned cost must move before the policy predicts with the new one: the
switch a tenth of the current figure (at least a millisecond), the share 2 points, the
contention 0.05."""
_SHARE_MOVED = 0.02
_CONTENTION_MOVED = 0.05


def _pooled(
    measured: list[SharingMeasured],
    value: Callable[[SharingMeasured], float],
    samples: Callable[[SharingMeasured], int],
    least: int,
) -> float | None:
    """The workers' mean of a cost, weighted by their samples; None below `least`."""
    n = sum(samples(m) for m in measured)
    if n < least or n == 0:
        return None
    return sum(value(m) * samples(m) for m in measured) / n


def learned(
    prior: SharingCosts, measured: Iterable[SharingMeasured | None], least: int
) -> SharingCosts:
    """`prior` with each cost the workers measured at least `least` times (together)
    replaced by their mean; `least` 0 keeps `prior` whole."""
    if least <= 0:
        return prior
    pool = [m for m in measured if m is not None]
    switch_s = _pooled(pool, lambda m: m.switch_s, lambda m: m.switches, least)
    share = _pooled(pool, lambda m: m.tail_share, lambda m: m.shared_calls, least)
    contention = _pooled(pool, lambda m: m.tail_contention, lambda m: m.tail_steps, least)
    return dataclasses.replace(
        prior,
        switch_s=prior.switch_s if switch_s is None else max(0.0, switch_s),
        tail_min_share=(
            prior.tail_min_share if share is None else min(max(0.0, share), 0.99 * MAX_TAIL_SHARE)
        ),
        tail_contention=prior.tail_contention if contention is None else max(1.0, contention),
    )


def moved(current: SharingCosts, new: SharingCosts) -> bool:
    """Whether `new` differs from `current` enough to predict with it instead."""
    if abs(new.switch_s - current.switch_s) > max(0.001, _SWITCH_MOVED * current.switch_s):
        return True
    if abs(new.tail_min_share - current.tail_min_share) > _SHARE_MOVED:
        return True
    return abs(new.tail_contention - current.tail_contention) > _CONTENTION_MOVED


def by_worker(
    pool: SharingCosts,
    measured: Mapping[str, SharingMeasured | None],
    before: Mapping[str, SharingCosts],
    least: int,
) -> dict[str, SharingCosts]:
    """Per worker, the costs of sharing its group is predicted with where they are its
    own: `pool` with each cost the worker measured at least `least` times replaced by its
    figure, kept where it moved off `pool` (`moved`), and kept as it was (`before`) until
    it moves again. A worker absent from `measured` (gone), or whose figures came back to
    the pool's, is left out: it is predicted with the pool's."""
    out: dict[str, SharingCosts] = {}
    for worker_id, mine in measured.items():
        own = learned(pool, [mine], least)
        if not moved(pool, own):
            continue
        kept = before.get(worker_id)
        out[worker_id] = kept if kept is not None and not moved(kept, own) else own
    return out

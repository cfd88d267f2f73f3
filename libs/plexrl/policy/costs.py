"""What sharing a group costs beyond moving states between tiers: one definition, which
the simulator's executor charges (`plexrl_sim.executor`) and the plexrl policy's
interference model predicts with (`plexrl.policy.plexrl_policy`).

Three costs, each a figure to set from a measurement of the worker:

- **Engine switch.** A Run whose job is not the job of the group's previous Run pays
  `switch_s` before its calls (the inference engine's sleep / wake, the KV cache handed
  over, communicators re-bound), though both states are on the device.
- **Stragglers' memory.** A rollout released at its tail (`TailReleased`) goes on
  decoding its stragglers in the background. While a Run is in flight on the group, the
  stragglers keep at least `tail_min_share` of it (their KV cache's memory and the
  engine's batch), so the Run computes at `1 - share` of the group's speed.
- **Tail contention.** While a Run is in flight on its group, a straggler tail decodes
  `tail_contention` times slower (its decode steps interleaved with the Run's kernels).
  Alone on an idle group it decodes at full speed.

The defaults are assumptions for a GPU, not GPU measurements. The simulator takes them
from its workload (`cluster.colocation`); the live scheduler from its settings
(`PLEXRL_SHARING_SWITCH_S`, `PLEXRL_SHARING_TAIL_MIN_SHARE`,
`PLEXRL_SHARING_TAIL_CONTENTION`) until its workers have measured them on their own
calls (`plexrl_worker.sharing`, `learned` below). `bench/tail_cost.py`
measures all three on the engine: on this CPU a straggler beside another job's calls
took 13-29% of the device and decoded 3-7x slower per step while a call ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from plexrl.messages import SharingMeasured

MAX_TAIL_SHARE = 0.9
"""The most of a group stragglers may hold beside a Run (however many tails): a Run
always makes some progress."""

CONTENTION_SCOPES = ("run", "shared")


@dataclass(frozen=True)
class SharingCosts:
    switch_s: float = 1.0
    """Seconds a group spends when a Run's job is not the job of its previous Run, both
    states on the device already. Calibrate from the live worker's timeline (the gap
    between two jobs' calls on one worker, swaps excluded)."""
    tail_min_share: float = 0.25
    """The least share of the group a rollout's stragglers take while a Run is in flight
    beside them, however few sequences are left. Calibrate from the engine's KV cache
    reservation against the group's memory."""
    tail_contention: float = 1.25
    """How many times slower a straggler tail decodes while a Run is in flight on its
    group; 1.0: no contention. `bench/tail_cost.py` measures it on the live engine."""
    contention_while: str = "run"
    """When a tail pays `tail_contention` and holds `tail_min_share`: `run`, while a Run
    is in flight on its group (what `bench/tail_cost.py` measures); `shared`, for the
    whole tail whenever another job is homed on the group, whether or not it runs (a
    pessimistic bound, kept for sensitivity runs)."""

    def __post_init__(self) -> None:
        if self.switch_s < 0:
            raise ValueError(f"switch_s is {self.switch_s}; use 0 or more (seconds)")
        if not 0 <= self.tail_min_share < MAX_TAIL_SHARE:
            raise ValueError(
                f"tail_min_share is {self.tail_min_share}; use 0 up to {MAX_TAIL_SHARE}"
            )
        if self.tail_contention < 1:
            raise ValueError(f"tail_contention is {self.tail_contention}; use 1.0 (none) or more")
        if self.contention_while not in CONTENTION_SCOPES:
            raise ValueError(
                f"contention_while is {self.contention_while!r}; use one of {CONTENTION_SCOPES}"
            )

    def figures(self) -> dict[str, float]:
        """The three costs by name, as the scheduler shows and exports them."""
        return {
            "switch_s": self.switch_s,
            "tail_min_share": self.tail_min_share,
            "tail_contention": self.tail_contention,
        }

    def tail_share(self, util: float) -> float:
        """The share of the group a tail using `util` of it alone holds beside a Run."""
        return util if util > self.tail_min_share else self.tail_min_share

    @staticmethod
    def run_speed(tail_shares: float) -> float:
        """The fraction of its speed a Run keeps beside tails holding `tail_shares`."""
        return 1.0 - (tail_shares if tail_shares < MAX_TAIL_SHARE else MAX_TAIL_SHARE)

    def stretch(self) -> float:
        """Extra seconds per second of a Run beside one tail at the least share."""
        share = min(self.tail_min_share, MAX_TAIL_SHARE)
        return share / (1.0 - share)


# Learned from measurements -------------------------------------------------------------
#
# Each worker measures what sharing costs on its own calls (`plexrl_worker.sharing`,
# carried by its heartbeat as `SharingMeasured`; in the simulator, its executor's
# charges). Once the pool measured a cost often enough, the mean replaces the prior (a
# setting, or the workload's); a worker that measured its own apart from the pool's
# (another engine, device or model size) has its group predicted with its own
# (`WorkerView.sharing`).

LEARN_SAMPLES = 20
"""How many times the pool must have measured a cost before it replaces the prior (the
live scheduler's default, `PLEXRL_SHARING_LEARN_SAMPLES`; the simulator's too)."""

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

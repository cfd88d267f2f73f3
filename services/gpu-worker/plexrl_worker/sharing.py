"""What sharing this worker costs, measured from its own calls: the three costs the plexrl
policy predicts placement and admission with (`plexrl.policy.costs.SharingCosts`), as
this worker's engine pays them. The heartbeat carries them (`SharingMeasured`) and the
scheduler predicts with them once it has enough samples.

- **Engine switch** (`switch_s`): a compute call whose job is not the job of the
  engine's previous call, no tail beside it, against the same job's calls that followed
  its own (seconds per unit of work, as they run alone). A call's compute starts once
  its state is on the device, so a swap before it is not counted (the simulator too
  charges the switch on top of the state's move).
- **Stragglers' share** (`tail_share`): a compute call that ran from start to end
  beside a released sample batch's tail, against the same baseline: the share of the
  device the tail took from it, `1 - alone / beside`.
- **Tail contention** (`tail_contention`): a released tail's decode steps while a
  compute call is in flight beside it, against its steps while none is (the mean step
  of each).

Compute calls are `forward_backward`, `forward` and `optim_step`, their work the tokens
they train on (one for `optim_step`). No I/O here: the runner tells the meter what ran.
"""

from __future__ import annotations

from dataclasses import dataclass

from plexrl.messages import ForwardBackwardInput, Function, PhaseInput, SharingMeasured
from plexrl.policy.costs import MAX_TAIL_SHARE

COMPUTE = (Function.FORWARD_BACKWARD, Function.FORWARD, Function.OPTIM_STEP)
_ALPHA = 0.2
"""Weight of a call's seconds per unit of work in its job's running baseline."""


def work_of(payload: PhaseInput) -> int:
    """A compute call's units of work: the tokens it runs (1 for one without data)."""
    if isinstance(payload, ForwardBackwardInput):
        return max(1, sum(len(datum.tokens) for datum in payload.data))
    return 1


@dataclass(frozen=True)
class Mark:
    """What stood when a compute call began: whether a released tail was decoding, and
    whether the engine's previous call was of another job."""

    tail: bool
    switched: bool


class _Mean:
    __slots__ = ("n", "total")

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0

    def add(self, value: float) -> None:
        self.n += 1
        self.total += value

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0


class SharingMeter:
    def __init__(self) -> None:
        self.running = 0
        """Compute calls in flight (a tail decodes beside them)."""
        self.tails = 0
        """Released sample batches still decoding."""
        self._last_jobs: frozenset[str] = frozenset()
        self._per_unit: dict[tuple[str, str], float] = {}
        """By job and function: seconds per unit of work, run alone after its own job."""
        self._switch = _Mean()
        self._share = _Mean()
        self._beside = _Mean()
        self._alone = _Mean()

    def call_began(self, job_id: str) -> Mark:
        """A compute call starts on the engine."""
        self.running += 1
        switched = bool(self._last_jobs) and self._last_jobs != {job_id}
        self._last_jobs = frozenset((job_id,))
        return Mark(tail=self.tails > 0, switched=switched)

    def call_ended(
        self, mark: Mark, job_id: str, function: str, work: int, compute_s: float
    ) -> None:
        """The compute call `call_began` marked ran for `compute_s` (0: it failed)."""
        self.running -= 1
        key = (job_id, function)
        per_unit = self._per_unit.get(key)
        tail_after = self.tails > 0
        if compute_s <= 0:
            return
        if not mark.tail and not tail_after:
            if not mark.switched:
                seen = compute_s / work
                self._per_unit[key] = (
                    seen if per_unit is None else per_unit + _ALPHA * (seen - per_unit)
                )
            elif per_unit is not None:
                self._switch.add(compute_s - per_unit * work)
        elif mark.tail and tail_after and per_unit is not None:
            own = compute_s - (self.switch_s if mark.switched else 0.0)
            if own > 0:
                share = 1.0 - per_unit * work / own
                self._share.add(min(max(share, 0.0), MAX_TAIL_SHARE))

    def batch_ran(self, job_ids: frozenset[str]) -> None:
        """A sample batch of these jobs ran on the engine (the next call may switch)."""
        self._last_jobs = job_ids

    def tail_step(self, seconds: float, beside: bool) -> None:
        """A released tail's decode step took `seconds`, a compute call in flight
        throughout (`beside`) or not at all."""
        (self._beside if beside else self._alone).add(seconds)

    @property
    def switch_s(self) -> float:
        return max(0.0, self._switch.mean)

    def measured(self) -> SharingMeasured:
        """What the heartbeat carries: each cost with the samples it rests on."""
        steps = min(self._beside.n, self._alone.n)
        return SharingMeasured(
            switch_s=self.switch_s,
            switches=self._switch.n,
            tail_share=self._share.mean,
            shared_calls=self._share.n,
            tail_contention=(max(1.0, self._beside.mean / self._alone.mean) if steps else 1.0),
            tail_steps=steps,
        )

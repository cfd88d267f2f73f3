"""Building blocks shared by every policy: admission checks, making room on a group,
the admission loop and the dispatch loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from plexrl.messages import Function, Tier
from plexrl.policy.actions import Action, Admit, Move, Reject, RejectReason, Run
from plexrl.policy.config import PolicyConfig
from plexrl.policy.share import beside_other_tenants
from plexrl.policy.snapshot import ClusterSnapshot, JobView, WorkerView

_DEVICE = Tier.DEVICE  # (read per decision: a module constant, not an enum class lookup)
_SAMPLE = Function.SAMPLE
_INF = float("inf")


def can_ever_hold(worker: WorkerView, job: JobView) -> bool:
    """Whether the group could run the job if it held nothing else: its device tier (its
    ranks' together) holds the job's share on every rank."""
    if worker.devices < job.devices:
        return False
    if job.base_model and worker.base_models and job.base_model not in worker.base_models:
        return False
    return job.group_bytes(worker.devices) <= worker.device_bytes


def refuse(snapshot: ClusterSnapshot, job: JobView) -> Reject:
    """A clear refusal that says what to change."""
    healthy = [w for w in snapshot.workers.values() if w.healthy]
    if not healthy:
        return Reject(job.job_id, RejectReason.NO_WORKERS, "no healthy worker has reported yet")
    if job.base_model and all(
        w.base_models and job.base_model not in w.base_models for w in healthy
    ):
        return Reject(
            job.job_id,
            RejectReason.NO_BASE_MODEL,
            f"no worker serves base model {job.base_model!r}",
        )
    return Reject(job.job_id, RejectReason.TOO_LARGE, too_large(job, healthy))


def too_large(job: JobView, workers: Sequence[WorkerView]) -> str:
    """Why no group of `workers` can hold `job`, in sizes, and what to change."""
    sizes = sorted({(w.devices, w.device_bytes // max(1, w.devices)) for w in workers})
    groups = ", ".join(f"{n} rank(s) x {per} bytes" for n, per in sizes)
    needs = ", ".join(
        f"{-(-job.group_bytes(n) // n)} bytes per rank on {n} rank(s)"
        for n in sorted({n for n, _ in sizes} | {max(job.devices, 1)})
    )
    return (
        f"job {job.job_id} cannot be placed: its state is {job.state_bytes} bytes (weights, "
        f"gradients and Adam moments; {job.replicated_bytes} of them held whole on every "
        f"rank), so it needs {needs}; the worker groups have {groups} of device memory "
        "for job states. Use LoRA or a smaller LoRA rank, or run workers with more ranks "
        "(PLEXRL_WORKER_RANKS) or more device memory per rank (PLEXRL_WORKER_DEVICE_BYTES)."
    )


def unplaceable(workers: Sequence[WorkerView], job: JobView) -> str | None:
    """Why no healthy group serving the job's base model can ever hold it (`too_large`);
    None when one can, or when none has reported yet (the job waits for one)."""
    base = job.base_model
    serving = [
        w for w in workers if w.healthy and (not base or not w.base_models or base in w.base_models)
    ]
    alone = replace(job, devices=1)
    if not serving or any(can_ever_hold(w, alone) for w in serving):
        return None
    return too_large(job, serving)


def fewest_devices(workers: Sequence[WorkerView], job: JobView) -> int:
    """The fewest ranks of a healthy group that could hold `job` alone: what the job
    needs (`JobView.devices`) when its size alone decides (1 when no group can)."""
    alone = replace(job, devices=1)
    return min((w.devices for w in workers if w.healthy and can_ever_hold(w, alone)), default=1)


def admit_least_loaded(snapshot: ClusterSnapshot, job: JobView) -> Admit | Reject:
    """Home the job on the fitting group with the least homed state (ties: fewest jobs, id)."""
    fits = [w for w in snapshot.workers.values() if w.healthy and can_ever_hold(w, job)]
    if not fits:
        return refuse(snapshot, job)

    def load(w: WorkerView) -> tuple[int, int, str]:
        homed = snapshot.homed_view(w.worker_id)
        return (sum(j.state_bytes for j in homed), len(homed), w.worker_id)

    return Admit(job.job_id, min(fits, key=load).worker_id)


def lru_key(job: JobView) -> tuple[float, ...]:
    """Eviction order: least recently active first."""
    return (job.last_active,)


def make_room(
    snapshot: ClusterSnapshot,
    worker_id: str,
    job: JobView,
    key: Callable[[JobView], tuple[float, ...]] = lru_key,
) -> tuple[Move, ...] | None:
    """Evictions (smallest `key` first; least recently active by default) that let `job`
    onto the group's device tier.

    Returns None when even evicting every idle resident would not make room (a
    running or pinned job cannot be evicted).
    """
    worker = snapshot.workers[worker_id]
    if job.tier == _DEVICE:
        return ()
    need = snapshot.device_used(worker_id) + job.state_bytes - worker.device_bytes
    if need <= 0:
        return ()
    host_free = worker.host_bytes - snapshot.host_used(worker_id)
    if job.tier == Tier.HOST:
        host_free += job.state_bytes  # it leaves the host tier as the victims arrive
    candidates = sorted(
        (
            j
            for j in snapshot.homed_view(worker_id)
            if j.tier == Tier.DEVICE
            and not j.pinned
            and j.job_id not in (job.job_id, worker.running)
        ),
        key=lambda j: (*key(j), j.job_id),
    )
    moves: list[Move] = []
    for victim in candidates:
        if need <= 0:
            break
        if victim.state_bytes <= host_free:
            moves.append(Move(victim.job_id, Tier.HOST))
            host_free -= victim.state_bytes
        else:
            moves.append(Move(victim.job_id, Tier.DISK))
        need -= victim.state_bytes
    return tuple(moves) if need <= 0 else None


def switch_s(snapshot: ClusterSnapshot, job: JobView, evict: tuple[Move, ...]) -> float:
    """Expected seconds to evict `evict` and bring `job` onto the device tier."""
    if not evict:
        return snapshot.swap.move_s(job.state_bytes, job.tier, _DEVICE)
    seconds = sum(
        snapshot.swap.move_s(
            snapshot.jobs[m.job_id].state_bytes, snapshot.jobs[m.job_id].tier, m.to_tier
        )
        for m in evict
    )
    return seconds + snapshot.swap.move_s(job.state_bytes, job.tier, Tier.DEVICE)


def apply_moves(
    snapshot: ClusterSnapshot,
    job_id: str,
    worker_id: str,
    moves: tuple[Move, ...],
    now_running: bool,
) -> ClusterSnapshot:
    """The snapshot as it will be once a Run's moves happen (for later decisions in one plan)."""
    jobs = dict(snapshot.jobs)
    for move in moves:
        jobs[move.job_id] = replace(jobs[move.job_id], tier=move.to_tier)
    jobs[job_id] = replace(jobs[job_id], tier=Tier.DEVICE)
    workers = dict(snapshot.workers)
    if now_running:
        workers[worker_id] = replace(workers[worker_id], running=job_id)
    return replace(snapshot, jobs=jobs, workers=workers)


def with_home(snapshot: ClusterSnapshot, job_id: str, worker_id: str) -> ClusterSnapshot:
    jobs = dict(snapshot.jobs)
    jobs[job_id] = replace(jobs[job_id], home=worker_id)
    return replace(snapshot, jobs=jobs)


# Admission -------------------------------------------------------------------------------

Placement = Callable[[ClusterSnapshot, JobView], str | None]
"""Chooses a home group for a job now, or None to make it wait."""


def reserved_bytes(snapshot: ClusterSnapshot, worker_id: str) -> int:
    """Bytes of every state homed on the group, whatever tier it is in (or not yet created)."""
    return sum(j.state_bytes for j in snapshot.homed_view(worker_id))


def fits_memory(snapshot: ClusterSnapshot, worker: WorkerView, job: JobView) -> bool:
    """Whether the group's device and host tiers together can hold `job` beside its homed jobs.

    The disk tier is overflow, never planned on: a state parked on disk costs seconds
    to bring back.
    """
    if not (worker.healthy and can_ever_hold(worker, job)):
        return False
    return (
        reserved_bytes(snapshot, worker.worker_id) + job.state_bytes
        <= worker.device_bytes + worker.host_bytes
    )


def load(snapshot: ClusterSnapshot, worker_id: str) -> float:
    """Sum of the duty cycles of the jobs homed on the group."""
    return sum(j.duty_cycle for j in snapshot.homed_view(worker_id))


def waiting_jobs(snapshot: ClusterSnapshot) -> list[JobView]:
    """Jobs with pending calls and no home yet, oldest first call first."""
    waiting: list[JobView] = []
    jobs = snapshot.jobs
    for job_id in snapshot.callers():
        job = jobs.get(job_id)
        if job is not None and job.home is None:
            waiting.append(job)
    return waiting


def admit_waiting(
    snapshot: ClusterSnapshot,
    place: Placement,
    backfill: bool,
    order: Callable[[list[JobView]], list[JobView]] | None = None,
) -> tuple[list[Action], ClusterSnapshot]:
    """Home waiting jobs in arrival order (or `order`'s) with `place`; refuse those no
    group can ever hold.

    Without `backfill` admission is strict FIFO: the first job that must wait holds
    back every later one. With it, later jobs that fit are admitted past it.
    """
    actions: list[Action] = []
    healthy = [w for w in snapshot.workers.values() if w.healthy]
    holdable: dict[tuple[int, str, int, int], bool] = {}  # by what `can_ever_hold` reads
    blocked = False
    waiting = waiting_jobs(snapshot)
    for job in order(waiting) if order is not None else waiting:
        size = (job.devices, job.base_model, job.state_bytes, job.replicated_bytes)
        held = holdable.get(size)
        if held is None:
            held = holdable[size] = any(can_ever_hold(w, job) for w in healthy)
        if not held:
            actions.append(refuse(snapshot, job))
            continue
        if blocked:
            continue
        worker_id = place(snapshot, job)
        if worker_id is None:
            blocked = not backfill
            continue
        actions.append(Admit(job.job_id, worker_id))
        snapshot = with_home(snapshot, job.job_id, worker_id)
    return actions, snapshot


# Dispatch --------------------------------------------------------------------------------

DispatchOrder = Callable[[ClusterSnapshot, WorkerView, list[JobView]], Sequence[JobView]]
"""Orders a free group's candidate jobs, most preferred first."""


def ready_by_worker(snapshot: ClusterSnapshot) -> dict[str, list[JobView]]:
    """Free healthy groups and their homed jobs that have pending calls."""
    ready: dict[str, list[JobView]] = {}
    jobs, workers = snapshot.jobs, snapshot.workers
    for job_id in snapshot.callers():
        job = jobs.get(job_id)
        if job is None or job.home is None:
            continue
        worker = workers.get(job.home)
        if worker is None or not worker.healthy or worker.running is not None:
            continue
        ready.setdefault(worker.worker_id, []).append(job)
    return ready


def oldest_call_first(
    snapshot: ClusterSnapshot, worker: WorkerView, jobs: list[JobView]
) -> Sequence[JobView]:
    """FIFO: the job whose oldest pending call arrived first."""
    return sorted(jobs, key=lambda j: (snapshot.calls_view(j.job_id)[0].arrival_time, j.job_id))


def run_of(
    snapshot: ClusterSnapshot,
    config: PolicyConfig,
    worker_id: str,
    job: JobView,
    evict: tuple[Move, ...],
    quantum_s: float | None = None,
    others: bool = False,
) -> Run:
    """A Run of the job's next pending calls (`ClusterSnapshot.calls_of`; with `others`,
    of its next calls that are not portable, its samples of saved weights having
    roamed): at most `max_calls_per_run`, and with a `quantum_s` only as many as fit in
    it by their expected seconds (at least one).

    Sample calls and others never share a Run: a Run of samples is released at its
    stragglers (the tail release), which calls behind them in the same Run would wait
    out; an asynchronous job's next sample and its training go as Runs of their own."""
    calls = snapshot.calls_view(job.job_id)
    if others:
        calls = [c for c in calls if not c.portable]
    calls = calls[: config.max_calls_per_run]
    if len(calls) > 1:
        sampling = calls[0].function == _SAMPLE
        for i in range(1, len(calls)):
            if (calls[i].function == _SAMPLE) != sampling:
                calls = calls[:i]
                break
    seconds_of, default_s = job.estimates.seconds, job.estimates.default_s
    expected = [seconds_of.get(c.function, default_s) for c in calls]  # expected_s, inlined
    if quantum_s is not None:
        total, keep = 0.0, 0
        for seconds in expected:
            total += seconds
            if keep and total > quantum_s:
                break
            keep += 1
        calls, expected = calls[:keep], expected[:keep]
    return Run(
        worker_id,
        job.job_id,
        tuple([c.request_id for c in calls]),
        evict,
        switch_s(snapshot, job, evict),
        sum(expected),
    )


def quiet_s(snapshot: ClusterSnapshot, worker_id: str, job: JobView) -> float:
    """Seconds before any other job homed on the group may want it: the nearest end of
    their idle hints; 0 when one has calls pending or gave no hint (it may call now)."""
    quiet, now = _INF, snapshot.now
    for other in snapshot.homed_view(worker_id):
        if other.job_id == job.job_id:
            continue
        if other.idle_until <= now or snapshot.calls_view(other.job_id):
            return 0.0
        quiet = min(quiet, other.idle_until - now)
    return quiet if quiet != _INF else 0.0


def quanta(config: PolicyConfig) -> tuple[float, float | None]:
    """The quantum a Run on a shared group stops at, and the shorter one beside another
    tenant's active job (with `fair_share`; None without): `run_quantum`."""
    return config.quantum_s, config.tenant_quantum_s if config.fair_share else None


def run_quantum(
    snapshot: ClusterSnapshot,
    worker_id: str,
    job: JobView,
    quantum_s: float | None,
    tenant_quantum_s: float | None = None,
) -> float | None:
    """The expected seconds a Run of `job` on the group may hold it before the group is
    decided again (None: no limit). With `quantum_s`, on a group shared with other jobs:
    the quantum, or `tenant_quantum_s` where another tenant's job is active there, unless
    every other job there said it will stay idle longer (`quiet_s`)."""
    if quantum_s is None or len(snapshot.homed_view(worker_id)) <= 1:
        return None
    slice_s = quantum_s
    if tenant_quantum_s is not None and beside_other_tenants(snapshot, worker_id, job):
        slice_s = min(quantum_s, tenant_quantum_s)
    return max(slice_s, quiet_s(snapshot, worker_id, job))


def dispatch(
    snapshot: ClusterSnapshot,
    config: PolicyConfig,
    order: DispatchOrder,
    key: Callable[[JobView], tuple[float, ...]] = lru_key,
    keep_snapshot: bool = False,
    quantum_s: float | None = None,
    tenant_quantum_s: float | None = None,
) -> tuple[list[Run], ClusterSnapshot]:
    """On every free group, run the first job in `order` that can be brought in.

    A job whose state cannot be made room for is passed over for the next (backfill
    within the group), so one oversized state never idles a group. Groups share no
    jobs, so each group's choice reads the snapshot as given; with `keep_snapshot` the
    returned snapshot shows the runs started (for later decisions in the same plan).
    With `quantum_s`, a Run on a group shared with other jobs stops at the quantum, so
    the group is decided again after it (time-slicing at call boundaries), unless every
    other job there said it will stay idle longer (`quiet_s`): then the Run goes on to
    that point, as nobody could cut in before it anyway. With `tenant_quantum_s` too, a
    Run on a group where another tenant's job is active stops at that shorter quantum
    (`plexrl.policy.share.beside_other_tenants`).
    """
    runs: list[Run] = []
    for worker_id, jobs in ready_by_worker(snapshot).items():
        worker = snapshot.workers[worker_id]
        for job in order(snapshot, worker, jobs):
            evict = make_room(snapshot, worker_id, job, key)
            if evict is None:
                continue
            quantum = run_quantum(snapshot, worker_id, job, quantum_s, tenant_quantum_s)
            runs.append(run_of(snapshot, config, worker_id, job, evict, quantum))
            break
    if keep_snapshot and runs:
        snapshot = after_runs(snapshot, runs)
    return runs, snapshot


def after_runs(snapshot: ClusterSnapshot, runs: Sequence[Run]) -> ClusterSnapshot:
    """The snapshot once `runs` have started: moves applied, their groups busy."""
    jobs = dict(snapshot.jobs)
    workers = dict(snapshot.workers)
    for run in runs:
        for move in run.evict:
            jobs[move.job_id] = replace(jobs[move.job_id], tier=move.to_tier)
        jobs[run.job_id] = replace(jobs[run.job_id], tier=Tier.DEVICE)
        workers[run.worker_id] = replace(
            workers[run.worker_id],
            running=run.job_id,
            busy_until=snapshot.now + run.expected_swap_s + run.expected_compute_s,
        )
    return replace(snapshot, jobs=jobs, workers=workers)


def size_class(snapshot: ClusterSnapshot, job: JobView) -> list[WorkerView]:
    """Healthy groups that can hold the job, of the smallest device count that can.

    A Run occupies a whole group, so a job on a group bigger than it needs would idle
    the difference: jobs share groups only with jobs of their own size class.
    """
    fitting = [w for w in snapshot.workers.values() if w.healthy and can_ever_hold(w, job)]
    if not fitting:
        return []
    smallest = min(w.devices for w in fitting)
    return sorted((w for w in fitting if w.devices == smallest), key=lambda w: w.worker_id)


def under_load_cap(
    snapshot: ClusterSnapshot, worker: WorkerView, job: JobView, max_load: float
) -> bool:
    """Memory holds the job, and the group's planned load stays within `max_load`
    (an empty group takes any job)."""
    if not fits_memory(snapshot, worker, job):
        return False
    homed = snapshot.homed_view(worker.worker_id)
    return not homed or sum(j.duty_cycle for j in homed) + job.duty_cycle <= max_load

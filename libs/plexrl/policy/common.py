"""Building blocks shared by every policy: admission checks and making room on a group."""

from __future__ import annotations

from dataclasses import replace

from plexrl.messages import Tier
from plexrl.policy.actions import Admit, Move, Reject, RejectReason
from plexrl.policy.snapshot import ClusterSnapshot, JobView, WorkerView


def can_ever_hold(worker: WorkerView, job: JobView) -> bool:
    """Whether the group could run the job if it held nothing else."""
    if worker.devices < job.devices:
        return False
    if job.base_model and worker.base_models and job.base_model not in worker.base_models:
        return False
    return job.state_bytes <= worker.device_bytes


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
    biggest = max(healthy, key=lambda w: (w.device_bytes, w.devices))
    return Reject(
        job.job_id,
        RejectReason.TOO_LARGE,
        f"job {job.job_id} needs {job.state_bytes} bytes of device memory on "
        f"{job.devices} device(s); the largest worker group has {biggest.device_bytes} bytes on "
        f"{biggest.devices} device(s). Use LoRA or a smaller rank, or give workers more "
        f"device memory (PLEXRL_WORKER_DEVICE_BYTES).",
    )


def admit_least_loaded(snapshot: ClusterSnapshot, job: JobView) -> Admit | Reject:
    """Home the job on the fitting group with the least homed state (ties: fewest jobs, id)."""
    fits = [w for w in snapshot.workers.values() if w.healthy and can_ever_hold(w, job)]
    if not fits:
        return refuse(snapshot, job)

    def load(w: WorkerView) -> tuple[int, int, str]:
        homed = snapshot.homed(w.worker_id)
        return (sum(j.state_bytes for j in homed), len(homed), w.worker_id)

    return Admit(job.job_id, min(fits, key=load).worker_id)


def make_room(snapshot: ClusterSnapshot, worker_id: str, job: JobView) -> tuple[Move, ...] | None:
    """Evictions (least recently active first) that let `job` onto the group's device tier.

    Returns None when even evicting every idle resident would not make room (a
    running job cannot be evicted).
    """
    worker = snapshot.workers[worker_id]
    if job.tier == Tier.DEVICE:
        return ()
    need = snapshot.device_used(worker_id) + job.state_bytes - worker.device_bytes
    if need <= 0:
        return ()
    host_free = worker.host_bytes - snapshot.host_used(worker_id)
    candidates = sorted(
        (
            j
            for j in snapshot.homed(worker_id)
            if j.tier == Tier.DEVICE and j.job_id not in (job.job_id, worker.running)
        ),
        key=lambda j: (j.last_active, j.job_id),
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

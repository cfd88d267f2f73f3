"""Which of a running job's next calls may follow its Run to its group at once.

A worker's dispatches queue on its topic, so the live scheduler may send a second one
behind the one running (`plexrl_scheduler.pipeline`) instead of waiting for it to end
and deciding again. That second dispatch is the Run the policy would have made: it
continues the running one as the policy's own rules allow, so the scheduler runs what
the policy (and the simulator, which asks it at the Run's end) would run.

- Only the job running there, and only while no other job homed on the group has calls
  waiting: choosing between jobs is the policy's, when the group is free.
- Never behind a sample batch, and never a sample: sample calls and others never share
  a Run (`common.run_of`), a sample batch is released at its stragglers and may yield
  to a neighbour (`preempt`), and an asynchronous job's training may wait out those
  stragglers (`defer`; nor does training follow while it would be passed over for
  them) — all decided when the batch ends. Samples are co-batched there.
- At most `max_calls_per_run` calls, in order.
- Under the plexrl policy, on a group shared with other jobs, only while the expected
  seconds of the Run's calls and these stay within the quantum it would have cut the
  Run at (`common.run_quantum`): a neighbour whose call comes during the Run waits
  for about a quantum, not for every call its job sends meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence

from plexrl.messages import Function
from plexrl.policy.common import quanta, run_quantum
from plexrl.policy.config import PolicyConfig
from plexrl.policy.defer import passed_over
from plexrl.policy.snapshot import ClusterSnapshot

_SAMPLE = Function.SAMPLE


def follow_up(
    snapshot: ClusterSnapshot, config: PolicyConfig, worker_id: str, running: Sequence[Function]
) -> tuple[str, ...]:
    """The request ids that may follow the group's running Run (whose calls are
    `running`, in order) at once, oldest first; empty: decide when it ends."""
    worker = snapshot.workers.get(worker_id)
    if worker is None or worker.running is None or not running or _SAMPLE in running:
        return ()
    job = snapshot.jobs.get(worker.running)
    if job is None or job.home != worker_id or passed_over(snapshot, worker, job, config.sharing):
        return ()
    for other in snapshot.homed_view(worker_id):
        if other.job_id != job.job_id and snapshot.calls_view(other.job_id):
            return ()
    quantum = None
    if config.name == "plexrl":
        quantum = run_quantum(snapshot, worker_id, job, *quanta(config))
    seconds_of, default_s = job.estimates.seconds, job.estimates.default_s
    used = sum(seconds_of.get(f, default_s) for f in running)
    taken: list[str] = []
    for call in snapshot.calls_view(job.job_id)[: config.max_calls_per_run]:
        if call.function == _SAMPLE:
            break
        used += seconds_of.get(call.function, default_s)
        if quantum is not None and used > quantum:
            break
        taken.append(call.request_id)
    return tuple(taken)

"""Placement by size: a job's state takes its share on every rank of a group (the
replicated part, a LoRA adapter, whole on each), and a group can hold it only if each
of its ranks can; a job no group can hold is refused with the sizes and what to change."""

from __future__ import annotations

from plexrl.messages import Function
from plexrl.policy import (
    Admit,
    ClusterSnapshot,
    JobView,
    PendingCall,
    PolicyConfig,
    Reject,
    WorkerView,
    plan,
)
from plexrl.policy.common import can_ever_hold, fewest_devices, unplaceable

MB = 10**6


def group(worker_id: str, ranks: int, per_rank: int) -> WorkerView:
    """A group as a worker reports it: its ranks' device memory together."""
    return WorkerView(worker_id, device_bytes=ranks * per_rank, host_bytes=10**12, devices=ranks)


FULL = JobView("full", 8 * MB)
LORA = JobView("lora", 3 * MB, replicated_bytes=3 * MB)


def test_a_sharded_state_fits_a_group_whose_ranks_each_hold_their_share() -> None:
    one, two = group("one", 1, 5 * MB), group("two", 2, 5 * MB)
    assert FULL.group_bytes(2) == 8 * MB  # 4 MB on each rank
    assert not can_ever_hold(one, FULL) and can_ever_hold(two, FULL)


def test_a_replicated_state_takes_its_whole_size_on_every_rank() -> None:
    assert LORA.group_bytes(2) == 6 * MB
    assert can_ever_hold(group("two", 2, 3 * MB), LORA)
    assert not can_ever_hold(group("two", 2, 2 * MB), LORA)  # more ranks do not help it
    big = JobView("big", 5 * MB, replicated_bytes=5 * MB)
    assert not can_ever_hold(group("four", 4, 4 * MB), big)


def test_a_job_needs_the_fewest_ranks_of_a_group_that_holds_it() -> None:
    pool = [group("a", 1, 5 * MB), group("b", 2, 5 * MB), group("c", 4, 5 * MB)]
    assert fewest_devices(pool, FULL) == 2
    assert fewest_devices(pool, LORA) == 1
    assert fewest_devices(pool, JobView("huge", 50 * MB)) == 1  # none holds it


def test_a_job_no_group_can_hold_is_named_with_the_sizes_and_what_to_change() -> None:
    pool = [group("a", 1, 5 * MB), group("b", 1, 5 * MB)]
    why = unplaceable(pool, FULL)
    assert why is not None
    assert "8000000 bytes" in why and "1 rank(s) x 5000000 bytes" in why
    assert "8000000 bytes per rank on 1 rank(s)" in why
    assert "PLEXRL_WORKER_RANKS" in why and "PLEXRL_WORKER_DEVICE_BYTES" in why
    assert unplaceable([*pool, group("c", 2, 5 * MB)], FULL) is None
    assert unplaceable([], FULL) is None  # no group has reported: the job waits
    stale = group("c", 2, 5 * MB)
    assert unplaceable([*pool, WorkerView("c", stale.device_bytes, 1, 2, healthy=False)], FULL)


def test_admission_places_a_job_only_on_a_group_that_holds_it_in_a_mixed_pool() -> None:
    pool = [group("small", 1, 5 * MB), group("pair", 2, 5 * MB)]
    jobs = {
        "full": JobView("full", 8 * MB, devices=fewest_devices(pool, FULL)),
        "too-big": JobView("too-big", 20 * MB),
    }
    snapshot = ClusterSnapshot(
        now=1.0,
        workers={w.worker_id: w for w in pool},
        jobs=jobs,
        pending=(
            PendingCall("r1", "full", Function.CREATE, 0.5),
            PendingCall("r2", "too-big", Function.CREATE, 0.6),
        ),
    )
    for policy in ("fifo", "plexrl"):
        actions = plan(snapshot, PolicyConfig(name=policy))
        assert Admit("full", "pair") in actions, policy
        (refused,) = [a for a in actions if isinstance(a, Reject)]
        assert refused.job_id == "too-big" and "2 rank(s) x 5000000 bytes" in refused.detail

"""Direct leases (plexrl.direct): the gateway's acceptance numbers and routes a leased
job's calls atomically; a grant waits for every earlier call; a revoke is one write
after which calls go the normal way and names what is still unanswered; the scheduler
holds the worker until then, and requeues in seq order what a dead worker lost.

Real Redis (the acceptance, grant, renew and revoke scripts); the scheduler's part runs
over a ClusterState with a fake clock, without Kafka.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest
from msgspec.structs import replace

from plexrl import direct
from plexrl.direct import DirectLeases, Granted, Route
from plexrl.lease import Fence
from plexrl.ledger import Ledger
from plexrl.messages import (
    AdamParams,
    CompletionStatus,
    ForwardBackwardInput,
    Function,
    JobSpec,
    LossFn,
    NoopInput,
    OptimStepInput,
    PhaseCompletion,
    PhaseInput,
    PhaseRequest,
    Tier,
    Timings,
    UnloadInput,
)
from plexrl.stores import Stores
from plexrl_gateway.outbox import MERGED_CALLS, Accept, Outbox
from plexrl_scheduler.direct import DirectConfig, DirectPath
from plexrl_scheduler.receiver import Receiver
from plexrl_scheduler.state import ClusterState
from tests.test_scheduler_state import Clock, beat, delivery

pytestmark = pytest.mark.integration

JOB, WORKER = "job-1", "w0"
PAYLOADS: dict[Function, PhaseInput] = {
    Function.FORWARD_BACKWARD: ForwardBackwardInput(data=[], loss_fn=LossFn.CROSS_ENTROPY),
    Function.OPTIM_STEP: OptimStepInput(adam=AdamParams()),
    Function.NOOP: NoopInput(),
    Function.UNLOAD: UnloadInput(),
}


def request(n: int, function: Function, job: str = JOB) -> PhaseRequest:
    return PhaseRequest(
        request_id=f"req-{n}",
        job_id=job,
        tenant="t",
        function=function,
        payload=PAYLOADS[function],
        arrival_time=time.time(),
    )


@dataclass
class Gateway:
    """The gateway's acceptance and flush over real Redis; `sent` is what it published."""

    outbox: Outbox
    sent: list[tuple[str, Route | None]] = field(default_factory=list)
    records: list[list[str]] = field(default_factory=list)
    """The request ids of each Kafka record the flushes sent."""
    n: int = 0

    async def call(self, *functions: Function, job: str = JOB) -> list[str]:
        requests = []
        for function in functions:
            self.n += 1
            requests.append(request(self.n, function, job))
        await self.outbox.accept(Accept(job_id=job, futures=[], requests=requests))
        return [r.request_id for r in requests]

    async def flush(self, job: str = JOB) -> list[tuple[str, Route | None]]:
        before = len(self.sent)

        async def send(rs: list[PhaseRequest], routes: list[Route] | None) -> asyncio.Future[None]:
            self.records.append([r.request_id for r in rs])
            for i, r in enumerate(rs):
                self.sent.append((r.request_id, None if routes is None else routes[i]))
            ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            ack.set_result(None)
            return ack

        await self.outbox.flush(job, send)
        return self.sent[before:]


@pytest.fixture
def gateway(stores: Stores) -> Gateway:
    return Gateway(Outbox(stores.keys))


@pytest.fixture
def ledger(stores: Stores, cluster_id: str) -> Ledger:
    return Ledger(stores.keys.redis, cluster_id)


@pytest.fixture
def leases(stores: Stores, cluster_id: str) -> DirectLeases:
    return DirectLeases(stores.keys.redis, cluster_id)


async def lease(ledger: Ledger, leases: DirectLeases, ttl_s: float = 30.0) -> Granted:
    epoch = await ledger.bump_epoch(JOB, WORKER)
    granted = await leases.grant(JOB, WORKER, epoch, ttl_s)
    assert isinstance(granted, Granted), granted
    return granted


async def answered(stores: Stores, *request_ids: str) -> None:
    """Record the completion of each call, as its worker does before publishing it."""
    for rid in request_ids:
        await stores.calls.record_completion(completion(rid, "direct:1:" + rid))


def completion(rid: str, dispatch_id: str, job: str = JOB) -> PhaseCompletion:
    return PhaseCompletion(
        request_id=rid,
        job_id=job,
        tenant="t",
        worker_id=WORKER,
        function=Function.FORWARD_BACKWARD,
        status=CompletionStatus.OK,
        timings=Timings(compute_s=0.01),
        dispatch_id=dispatch_id,
    )


async def waiting(stores: Stores, cluster_id: str) -> int:
    return int(await stores.keys.redis.hget(f"{cluster_id}:ledger:{JOB}", "waiting") or 0)


# The acceptance and the lease record ----------------------------------------------------


async def test_calls_accepted_under_a_live_lease_are_numbered_there_and_routed_in_order(
    gateway: Gateway, ledger: Ledger, leases: DirectLeases
) -> None:
    granted = await lease(ledger, leases)
    fb, opt = await gateway.call(Function.FORWARD_BACKWARD, Function.OPTIM_STEP)
    (noop,) = await gateway.call(Function.NOOP)
    sent = await gateway.flush()
    assert [rid for rid, _ in sent] == [fb, opt, noop]
    assert [route for _, route in sent] == [
        Route(WORKER, 1, granted.lease_id, 1),
        Route(WORKER, 1, granted.lease_id, 2),
        Route(WORKER, 1, granted.lease_id, 0),  # unnumbered: pure, in no order
    ]
    # The ledger numbered them: the scheduler's assign gives a replay the same seq.
    assert await ledger.assign(JOB, [opt, fb]) == [2, 1]
    assert gateway.records == [[fb, opt, noop]]  # one dispatch to the worker


async def test_a_flushs_direct_calls_share_records_within_bounds_and_leases(
    gateway: Gateway, ledger: Ledger, leases: DirectLeases
) -> None:
    await lease(ledger, leases)
    noops = [rid for _ in range(MERGED_CALLS + 3) for rid in await gateway.call(Function.NOOP)]
    await gateway.flush()
    assert gateway.records == [noops[:MERGED_CALLS], noops[MERGED_CALLS:]]
    await leases.revoke(JOB)  # the calls after it go to the scheduler, a record each
    after = [rid for _ in range(2) for rid in await gateway.call(Function.NOOP)]
    await gateway.flush()
    assert gateway.records[2:] == [[after[0]], [after[1]]]


async def test_without_a_lease_sequenced_calls_wait_unnumbered_until_assigned(
    gateway: Gateway, ledger: Ledger, stores: Stores, cluster_id: str
) -> None:
    fb, noop = await gateway.call(Function.FORWARD_BACKWARD, Function.NOOP)
    assert await gateway.flush() == [(fb, None), (noop, None)]
    assert gateway.records == [[fb], [noop]]  # to the scheduler: a record each
    assert await waiting(stores, cluster_id) == 1  # the noop is never numbered
    assert await ledger.assign(JOB, [fb]) == [1]
    assert await ledger.assign(JOB, [fb]) == [1]  # a replay counts nothing off again
    assert await waiting(stores, cluster_id) == 0


async def test_a_sequenced_call_that_cannot_go_direct_ends_the_lease_for_those_after(
    gateway: Gateway, ledger: Ledger, leases: DirectLeases, stores: Stores, cluster_id: str
) -> None:
    await lease(ledger, leases)
    (unload,) = await gateway.call(Function.UNLOAD)
    (fb,) = await gateway.call(Function.FORWARD_BACKWARD)
    # Numbered by the scheduler later, UNLOAD must not be overtaken by a direct call.
    assert await gateway.flush() == [(unload, None), (fb, None)]
    assert await waiting(stores, cluster_id) == 2
    assert await leases.renew({JOB: 1}, 30.0) == {JOB: False}


async def test_a_lease_is_granted_only_when_every_earlier_call_has_applied(
    gateway: Gateway, ledger: Ledger, leases: DirectLeases, stores: Stores, cluster_id: str
) -> None:
    epoch = await ledger.bump_epoch(JOB, WORKER)
    (fb,) = await gateway.call(Function.FORWARD_BACKWARD)
    assert await leases.grant(JOB, WORKER, epoch, 30.0) == "waiting"  # not numbered yet
    await ledger.assign(JOB, [fb])
    assert await leases.grant(JOB, WORKER, epoch, 30.0) == "unapplied"  # not applied yet
    await ledger.commit(JOB, epoch, 1, completion(fb, "d"), None)
    assert await leases.grant(JOB, "w1", epoch, 30.0) == "epoch"  # not its home
    assert await leases.grant(JOB, WORKER, epoch + 1, 30.0) == "epoch"
    assert isinstance(await leases.grant(JOB, WORKER, epoch, 30.0), Granted)
    assert await leases.grant(JOB, WORKER, epoch, 30.0) == "held"


async def test_a_revoke_names_the_unanswered_calls_and_later_calls_go_the_normal_way(
    gateway: Gateway, ledger: Ledger, leases: DirectLeases, stores: Stores
) -> None:
    granted = await lease(ledger, leases)
    first, second = await gateway.call(Function.FORWARD_BACKWARD, Function.OPTIM_STEP)
    await gateway.flush()
    await answered(stores, first)
    revoked = await leases.revoke(JOB)
    assert (revoked.lease_id, revoked.high) == (granted.lease_id, 2)
    assert list(revoked.outstanding) == [second]
    route, entry = direct.read_element(revoked.outstanding[second])
    assert route == Route(WORKER, 1, granted.lease_id, 2) and entry.request.request_id == second
    (after,) = await gateway.call(Function.FORWARD_BACKWARD)
    assert await gateway.flush() == [(after, None)]
    assert await ledger.assign(JOB, [after]) == [3]  # above every direct number


async def test_a_lapsed_lease_sends_calls_the_normal_way_and_is_not_renewed(
    gateway: Gateway, ledger: Ledger, leases: DirectLeases
) -> None:
    granted = await lease(ledger, leases, ttl_s=0.05)
    await asyncio.sleep(0.1)
    (fb,) = await gateway.call(Function.FORWARD_BACKWARD)
    assert await gateway.flush() == [(fb, None)]
    assert await leases.renew({JOB: granted.lease_id}, 30.0) == {JOB: False}


async def test_a_re_homed_job_sends_calls_the_normal_way(
    gateway: Gateway, ledger: Ledger, leases: DirectLeases
) -> None:
    await lease(ledger, leases)
    await ledger.bump_epoch(JOB, "")  # its worker died: fenced off
    (fb,) = await gateway.call(Function.FORWARD_BACKWARD)
    assert await gateway.flush() == [(fb, None)]


async def test_renewal_extends_the_lease_and_forgets_the_answered_calls(
    gateway: Gateway, ledger: Ledger, leases: DirectLeases, stores: Stores
) -> None:
    granted = await lease(ledger, leases, ttl_s=0.3)
    first, second = await gateway.call(Function.FORWARD_BACKWARD, Function.OPTIM_STEP)
    await answered(stores, first)
    for _ in range(3):
        await asyncio.sleep(0.15)
        assert await leases.renew({JOB: granted.lease_id}, 0.3) == {JOB: True}
    calls = await stores.keys.redis.hkeys(leases.calls_key(JOB))
    assert calls == [second.encode()]


async def test_a_deposed_scheduler_neither_grants_nor_renews(
    ledger: Ledger, leases: DirectLeases, stores: Stores, cluster_id: str
) -> None:
    token_key = f"{cluster_id}:lease:scheduler:token"
    await stores.keys.redis.set(token_key, 1)
    first_term = DirectLeases(stores.keys.redis, cluster_id, Fence(token_key, 1))
    epoch = await ledger.bump_epoch(JOB, WORKER)
    granted = await first_term.grant(JOB, WORKER, epoch, 30.0)
    assert isinstance(granted, Granted)
    await stores.keys.redis.set(token_key, 2)  # a newer term began
    assert await first_term.renew({JOB: granted.lease_id}, 30.0) == {JOB: False}
    await leases.revoke(JOB)
    assert await first_term.grant(JOB, WORKER, epoch, 30.0) == "fenced"
    second_term = DirectLeases(stores.keys.redis, cluster_id, Fence(token_key, 2))
    assert isinstance(await second_term.grant(JOB, WORKER, epoch, 30.0), Granted)


# The scheduler's part ----------------------------------------------------------------


@dataclass
class Scheduler:
    state: ClusterState
    path: DirectPath
    clock: Clock


def scheduler(leases: DirectLeases, grace_s: float = 5.0) -> Scheduler:
    clock = Clock()
    state = ClusterState(clock=clock, worker_timeout_s=10.0)
    state.on_heartbeat(beat(WORKER))
    state.on_heartbeat(beat("w1"))
    path = DirectPath(state, leases, DirectConfig(ttl_s=30.0, grace_s=grace_s), clock=clock)
    return Scheduler(state, path, clock)


async def resident_after_a_dispatch(s: Scheduler, ledger: Ledger) -> None:
    """The job ran one call on its home and it applied: it is resident and active."""
    epoch = await ledger.bump_epoch(JOB, WORKER)
    s.state.add_job(JOB, "t", JobSpec(base_model="m"), home=WORKER)
    s.state.apply_admit(JOB, WORKER, epoch)
    s.state.on_request(request(0, Function.FORWARD_BACKWARD), delivery(0))
    (seq,) = await ledger.assign(JOB, ["req-0"])
    s.state.apply_run("d0", WORKER, JOB, s.state.take_pending(("req-0",)), ())
    await ledger.commit(JOB, epoch, seq, completion("req-0", "d0"), None)
    s.state.on_completion(replace(completion("req-0", "d0"), last_in_dispatch=True))
    assert s.state.jobs[JOB].tier == Tier.DEVICE


@pytest.fixture
async def leased(ledger: Ledger, leases: DirectLeases) -> Scheduler:
    """A scheduler whose job ran a dispatch on its home, then got a direct lease there
    (grace for calls on the way: 5 s)."""
    s = scheduler(leases)
    await resident_after_a_dispatch(s, ledger)
    await s.path.step()
    return s


async def test_a_job_whose_dispatch_ends_with_nothing_queued_gets_a_lease(
    gateway: Gateway, leased: Scheduler
) -> None:
    assert leased.state.held == {WORKER: JOB}
    assert leased.state.snapshot().workers[WORKER].running == JOB  # the policy sees it busy
    (fb,) = await gateway.call(Function.FORWARD_BACKWARD)
    assert [(rid, route.seq if route else None) for rid, route in await gateway.flush()] == [
        (fb, 2)
    ]


async def test_a_job_whose_next_call_runs_behind_its_ended_dispatch_gets_a_lease(
    gateway: Gateway, ledger: Ledger, leases: DirectLeases
) -> None:
    """A client one call at a time sends its next call before the scheduler sees the
    last one's completion (it reads completions up to a fetch's wait late): that call is
    dispatched the normal way, and the lease is granted behind it, not only when the
    worker is idle; another job's dispatch on the worker keeps it ungranted."""
    s = scheduler(leases)
    await resident_after_a_dispatch(s, ledger)
    s.state.on_request(request(1, Function.NOOP), delivery(1))
    s.state.apply_run("d1", WORKER, JOB, s.state.take_pending(("req-1",)), ())
    await s.path.step()
    assert s.state.held == {WORKER: JOB}
    (fb,) = await gateway.call(Function.FORWARD_BACKWARD)
    assert [(rid, route.seq if route else None) for rid, route in await gateway.flush()] == [
        (fb, 2)
    ]
    # A call of the job that came the normal way does not follow the dispatch in
    # flight (the direct call may be on the worker's topic already): it revokes the
    # lease, and the worker stays held after the dispatch ends, until the direct call
    # is answered.
    s.state.on_request(request(3, Function.NOOP), delivery(3))
    assert s.state.follow_up_running(WORKER) is None
    s.state.on_completion(replace(completion("req-1", "d1"), last_in_dispatch=True))
    await s.path.step()
    (late,) = await gateway.call(Function.FORWARD_BACKWARD)
    assert (await gateway.flush())[0] == (late, None)  # revoked: the normal way
    assert s.state.held == {WORKER: JOB} and s.path.status()["draining"] == 1


async def test_no_lease_while_another_jobs_dispatch_runs_on_the_worker(
    ledger: Ledger, leases: DirectLeases
) -> None:
    s = scheduler(leases)
    await resident_after_a_dispatch(s, ledger)
    other = "job-2"
    s.state.add_job(other, "t", JobSpec(base_model="m"), home=WORKER)
    s.state.apply_admit(other, WORKER, await ledger.bump_epoch(other, WORKER))
    s.state.on_request(request(1, Function.NOOP, job=other), delivery(1))
    s.state.apply_run("d1", WORKER, other, s.state.take_pending(("req-1",)), ())
    await s.path.step()
    assert s.state.held == {}


async def test_no_lease_for_an_asynchronous_job_on_a_worker_that_slices_training(
    ledger: Ledger, leases: DirectLeases
) -> None:
    # Its training stays the scheduler's to preempt between micro-batches.
    s = scheduler(leases)
    s.state.on_heartbeat(replace(beat(WORKER), slices_training=True))
    await resident_after_a_dispatch(s, ledger)
    s.state.on_job_options(JOB, 1)
    await s.path.step()
    assert s.state.held == {}


async def test_a_job_due_for_review_has_its_lease_taken_back_and_gets_none(
    ledger: Ledger, leases: DirectLeases
) -> None:
    """The policy reviews a newcomer's home (or a job's left alone) only while it sees
    the job between calls, and a held worker shows the job running: a job alone on its
    worker that keeps calling would never be reviewed. Its lease is taken back once its
    review is due, and none is granted until the review is done."""
    clock = Clock()
    state = ClusterState(clock=clock, worker_timeout_s=10.0, review_histories=1.0)
    state.on_heartbeat(beat(WORKER))
    path = DirectPath(state, leases, DirectConfig(ttl_s=30.0), clock=clock)
    s = Scheduler(state, path, clock)
    await resident_after_a_dispatch(s, ledger)
    await path.step()
    assert state.held == {WORKER: JOB} and not state.due_for_review(JOB)
    clock.t += 6.0  # 5 s of history: its home is due for review
    assert state.due_for_review(JOB)
    await path.step()
    assert state.held == {} and path.status()["live"] == 0
    assert state.snapshot().jobs[JOB].review  # the next whole decision reviews it
    # Its next dispatch ends: still under review, no lease.
    await dispatched(state, ledger, 1)
    await path.step()
    assert state.held == {}
    # Reviewed (kept where it is): its next dispatch's end grants a lease again.
    state.apply_review(JOB)
    await dispatched(state, ledger, 2)
    await path.step()
    assert state.held == {WORKER: JOB}


async def dispatched(state: ClusterState, ledger: Ledger, n: int) -> None:
    """The job's call `n` came the normal way, ran on its home and applied."""
    rid, dispatch_id = f"req-{n}", f"d{n}"
    state.on_request(request(n, Function.FORWARD_BACKWARD), delivery(n))
    (seq,) = await ledger.assign(JOB, [rid])
    state.apply_run(dispatch_id, WORKER, JOB, state.take_pending((rid,)), ())
    epoch = state.jobs[JOB].epoch
    await ledger.commit(JOB, epoch, seq, completion(rid, dispatch_id), None)
    state.on_completion(replace(completion(rid, dispatch_id), last_in_dispatch=True))


async def test_without_re_homing_a_newcomer_keeps_its_lease(
    ledger: Ledger, leases: DirectLeases
) -> None:
    clock = Clock()
    state = ClusterState(clock=clock, worker_timeout_s=10.0, review_histories=1.0, review=False)
    state.on_heartbeat(beat(WORKER))
    path = DirectPath(state, leases, DirectConfig(ttl_s=30.0), clock=clock)
    await resident_after_a_dispatch(Scheduler(state, path, clock), ledger)
    await path.step()
    clock.t += 6.0
    await path.step()
    assert state.held == {WORKER: JOB} and not state.due_for_review(JOB)


async def test_a_call_queued_for_a_held_worker_revokes_and_it_stays_held_until_answered(
    gateway: Gateway, leased: Scheduler
) -> None:
    fb, opt = await gateway.call(Function.FORWARD_BACKWARD, Function.OPTIM_STEP)
    sent = await gateway.flush()
    # Another job homed there has a call: the lease ends, the direct calls still run.
    leased.state.add_job("job-2", "t", JobSpec(base_model="m"), home=WORKER)
    leased.state.on_request(request(9, Function.NOOP, job="job-2"), delivery(9))
    await leased.path.step()
    (late,) = await gateway.call(Function.FORWARD_BACKWARD)
    assert (await gateway.flush())[0] == (late, None)  # revoked: the normal way
    assert leased.state.held == {WORKER: JOB}
    assert not await leased.path.clear(WORKER)  # the actuator waits
    for rid, route in sent:
        assert route is not None
        leased.state.on_direct_completion(completion(rid, direct.dispatch_id(route.lease_id, rid)))
        leased.path.on_completion(completion(rid, direct.dispatch_id(route.lease_id, rid)))
    assert leased.state.held == {} and await leased.path.clear(WORKER)
    assert {rid for rid, _ in sent} == {fb, opt}


async def test_a_dead_workers_direct_calls_go_back_to_the_queue_in_seq_order(
    gateway: Gateway, ledger: Ledger, stores: Stores, leased: Scheduler
) -> None:
    noop, fb, opt = await gateway.call(
        Function.NOOP, Function.FORWARD_BACKWARD, Function.OPTIM_STEP
    )
    await gateway.flush()
    leased.state.on_request(request(50, Function.FORWARD_BACKWARD), delivery(50))  # came after
    await answered(stores, fb)  # ran before the worker died; opt and noop did not
    leased.clock.t += 11
    leased.state.on_heartbeat(replace(beat("w1"), sent_at=leased.clock.t))
    assert leased.state.lost_workers() == [WORKER]
    leased.state.on_worker_lost(WORKER)
    await ledger.bump_epoch(JOB, "")
    await leased.path.worker_lost(WORKER)
    assert leased.state.held == {}
    # Numbered first, in seq order, ahead of what came the normal way; then the noop.
    assert list(leased.state.pending)[:3] == [opt, noop, "req-50"]
    assert leased.path.requeued == 2


async def test_calls_lost_on_the_way_are_requeued_once_the_worker_reports_idle(
    gateway: Gateway, leased: Scheduler
) -> None:
    (fb,) = await gateway.call(Function.FORWARD_BACKWARD)  # its gateway died: never sent
    assert not await leased.path.clear(WORKER)
    leased.clock.t += 3
    leased.state.on_heartbeat(replace(beat(WORKER), sent_at=leased.clock.t))
    await leased.path.step()
    assert leased.state.held == {WORKER: JOB}  # inside the grace (5 s): it may still arrive
    leased.clock.t += 3
    leased.state.on_heartbeat(replace(beat(WORKER), sent_at=leased.clock.t))
    await leased.path.step()
    assert leased.state.held == {} and list(leased.state.pending) == [fb]


@pytest.mark.usefixtures("leased")
async def test_a_restarted_scheduler_revokes_what_it_finds_and_holds_until_answered(
    gateway: Gateway, leases: DirectLeases
) -> None:
    (fb,) = await gateway.call(Function.FORWARD_BACKWARD)
    sent = await gateway.flush()
    after = scheduler(leases)  # the first one died with the lease live
    after.state.add_job(JOB, "t", JobSpec(base_model="m"), home=WORKER)
    await after.path.restore([JOB])
    (late,) = await gateway.call(Function.FORWARD_BACKWARD)
    assert (await gateway.flush())[0] == (late, None)
    assert after.state.held == {WORKER: JOB}
    route = sent[0][1]
    assert route is not None
    after.path.on_completion(completion(fb, direct.dispatch_id(route.lease_id, fb)))
    assert after.state.held == {}


async def test_a_requeued_direct_call_answered_under_its_first_dispatch_id_frees_the_worker(
    ledger: Ledger, leases: DirectLeases, stores: Stores
) -> None:
    s = scheduler(leases)
    s.state.add_job(JOB, "t", JobSpec(base_model="m"), home="w1")
    call = request(7, Function.FORWARD_BACKWARD)
    s.state.requeue_direct([call])  # its worker died after committing it
    s.state.apply_run("d1", "w1", JOB, s.state.take_pending((call.request_id,)), ())
    receiver = Receiver(s.state, stores.jobs, stores.usage, s.path)
    # The new home answers it from the ledger: the stored completion names the dispatch
    # it first ran under, a direct one.
    first_id = direct.dispatch_id(1, call.request_id)
    await receiver.on_completion(completion(call.request_id, first_id), delivery(1))
    assert "w1" not in s.state.inflight and not s.state.knows_request(call.request_id)


@pytest.mark.usefixtures("leased")
async def test_a_lease_found_on_a_worker_its_job_has_left_is_requeued_at_once(
    gateway: Gateway, leases: DirectLeases
) -> None:
    (fb,) = await gateway.call(Function.FORWARD_BACKWARD)
    await gateway.flush()
    # The worker died and the job went elsewhere; the scheduler died before requeueing.
    after = scheduler(leases)
    after.state.add_job(JOB, "t", JobSpec(base_model="m"), home="w1")
    await after.path.restore([JOB])
    await after.path.step()
    assert after.state.held == {} and list(after.state.pending) == [fb]

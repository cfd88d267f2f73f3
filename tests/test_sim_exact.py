"""A scenario small enough to compute by hand, checked to the last second."""

from __future__ import annotations

import pytest

from plexrl.messages import Function
from plexrl_sim.multiplexed import MultiplexedSim
from plexrl_sim.report import makespan_floor_s
from plexrl_sim.run import policy_config, prepare, run_deployment
from tests.sim_fixtures import two_jobs_one_worker, write_workload


@pytest.mark.parametrize("policy", ["fifo", "spread-backfill"])
def test_two_jobs_share_one_worker_exactly(tmp_path, policy):
    # A and B arrive at 0 on the only worker. A's create (0 s) runs first, then A's sample
    # [0,2]; B's create and sample [2,4]; A trains [5,6] after its 3 s reward, samples
    # again [6,8]; B's train is ready at 7 but waits for A's sample: [8,9]; B samples
    # [9,11]; A trains [11,12] and is done; B trains [14,15] and is done.
    setup = prepare(write_workload(tmp_path, two_jobs_one_worker()))
    result = run_deployment(setup, policy)
    a, b = (next(j for j in result.jobs if j.job_id == x) for x in ("A", "B"))
    assert result.makespan_s == pytest.approx(15.0)
    assert a.finish_s == pytest.approx(12.0) and b.finish_s == pytest.approx(15.0)
    assert a.step_time_s == pytest.approx(12.0) and a.isolated_step_time_s == pytest.approx(12.0)
    assert b.step_time_s == pytest.approx(13.0)
    assert a.slowdown == pytest.approx(0.0) and b.slowdown == pytest.approx(1 / 12)
    # B waited 2 s to create, then 1 s for its first train.
    assert b.call_queue_s == pytest.approx(2.0 + 1.0)
    assert a.call_queue_s == pytest.approx(0.0)
    assert a.used_device_s == pytest.approx(6.0) and b.used_device_s == pytest.approx(6.0)
    # The worker was held 15 s, split by use.
    assert a.occupied_gpu_s == pytest.approx(7.5) and b.occupied_gpu_s == pytest.approx(7.5)
    assert a.swaps == b.swaps == 0


def test_switching_between_resident_jobs_costs_the_engine_switch(tmp_path):
    # As above, with 1 s whenever the worker runs another job than its previous Run's
    # (both states resident): A create+sample [0,2]; B switch, create+sample [3,5];
    # A switch, train [6,7], samples [7,9]; B (train ready at 8) switch, train [10,11],
    # samples [11,13]; A (ready at 12) switch, train [14,15], done; B (ready at 16)
    # switch, train [17,18], done.
    setup = prepare(write_workload(tmp_path, two_jobs_one_worker(switch_s=1.0)))
    result = run_deployment(setup, "fifo")
    a, b = (next(j for j in result.jobs if j.job_id == x) for x in ("A", "B"))
    assert a.finish_s == pytest.approx(15.0) and b.finish_s == pytest.approx(18.0)
    # Switches are charged like swaps: 2 to A, 3 to B, on top of 6 s of calls each.
    assert a.swap_s == pytest.approx(2.0) and b.swap_s == pytest.approx(3.0)
    assert a.used_device_s == pytest.approx(8.0) and b.used_device_s == pytest.approx(9.0)


def test_isolated_reference_is_the_same_steps_alone(tmp_path):
    setup = prepare(write_workload(tmp_path, two_jobs_one_worker()))
    result = run_deployment(setup, "isolated")
    a, b = result.jobs
    # One worker, so B waits for A's whole run: 12 s.
    assert a.finish_s == pytest.approx(12.0)
    assert b.start_s == pytest.approx(12.0) and b.finish_s == pytest.approx(24.0)
    assert result.bubble_ratio() == pytest.approx(1 - 6 / 12)
    # Both arrived at 0 and take 12 s alone: nothing can finish them before 12 s.
    assert makespan_floor_s(result) == pytest.approx(12.0)


def test_swaps_cost_bytes_over_bandwidth(tmp_path):
    # Only one 10-byte state fits on the 10-byte device tier; 10 B/s makes every move 1 s.
    doc = two_jobs_one_worker(device_bytes=10, bandwidth=10.0)
    setup = prepare(write_workload(tmp_path, doc))
    result = run_deployment(setup, "fifo")
    a, b = (next(j for j in result.jobs if j.job_id == x) for x in ("A", "B"))
    # A samples [0,2]. B's create needs room: evict A (1 s), create (free): [2,3]; B
    # samples [3,5]. A's train (ready 5): evict B + onload A + 1 s: [5,8]. At 8 B's
    # reward stall ends and A's next step begins; simultaneous events are handled in a
    # fixed order (a stall's end before a step's start), so B trains first: [8,11]. A
    # samples [11,15], B samples [15,19], A trains [19,22] and is done, B trains
    # [22,25] and is done. Every switch after the first costs 2 s of swaps.
    assert a.finish_s == pytest.approx(22.0)
    assert b.finish_s == pytest.approx(25.0)
    assert a.swap_s == pytest.approx(6.0) and b.swap_s == pytest.approx(7.0)
    # Moves of each job's state: A evicted 4 times and onloaded 3; B evicted 3, onloaded 3.
    assert (a.swaps, b.swaps) == (7, 6)
    assert a.swapped_bytes == pytest.approx(70.0)


def test_trail_records_every_phase_in_order(tmp_path):
    setup = prepare(write_workload(tmp_path, two_jobs_one_worker()))
    sim = MultiplexedSim(
        setup.factory,
        setup.jobs,
        setup.groups,
        policy_config(setup, "fifo", {}),
        setup.gpus,
        record_trail=True,
    )
    sim.run()
    step = [Function.SAMPLE, Function.FORWARD_BACKWARD, Function.OPTIM_STEP, Function.SAVE]
    for trail in sim.trails().values():
        assert trail == [(0, Function.CREATE)] + [(k, f) for k in range(2) for f in step]


def test_plexrl_runs_the_shortest_remaining_work_first(tmp_path):
    # A at 0 and B at 14: sample 2 s, reward 7 s, then four 1 s forward_backward calls
    # (optim_step and save take no time), three steps each, one worker, a budget that
    # lets them share, decisions at every call boundary (quantum 0.5 s), and figures
    # learned from the calls after 10 s of history.
    doc = two_jobs_one_worker()
    doc["profiles"]["p"].update(reward_s=7.0, train_s=4.0, fb_calls=4)
    doc["jobs"][1]["arrival_s"] = 14.0
    for job in doc["jobs"]:
        job["steps"] = 3
    doc["policy"] = {"slowdown_budget": 10.0, "quantum_s": 0.5}
    doc["estimates"] = {"min_history_s": 10.0}
    setup = prepare(write_workload(tmp_path, doc))
    # A alone: samples [0,2], trains [9,13] in one Run, samples [13,15]. B, admitted at
    # 14 on A's measured figures, creates at once (A's sample yields to its create, which
    # takes no time) and samples [15,17]. A's training arrives at
    # 22 and goes one call per Run (B is homed and has no idle hint yet): [22,26]. B's
    # training arrives at 24 and starts at 26 [26,27]; at 27 A's next 2 s sample cuts in
    # before B's remaining 3 s [27,29]; B [29,32], samples [32,34]. A trains [36,40] in
    # one Run (B's idle hint, the mean of its one stall, says it is quiet until 41) and
    # is done; B trains [41,45], samples [45,47], trains [54,58] and is done.
    result = run_deployment(setup, "plexrl")
    a, b = (next(j for j in result.jobs if j.job_id == x) for x in ("A", "B"))
    assert a.finish_s == pytest.approx(40.0) and b.finish_s == pytest.approx(58.0)
    assert a.call_queue_s == pytest.approx(1.0) and b.call_queue_s == pytest.approx(5.0)
    # Oldest call first instead: A 43, B 60, and they wait 4 s and 7 s.
    fifo = run_deployment(setup, "fifo")
    assert [j.finish_s for j in fifo.jobs] == pytest.approx([43.0, 60.0])
    assert [j.call_queue_s for j in fifo.jobs] == pytest.approx([4.0, 7.0])

"""Asynchronous jobs in the simulator: the two-lane loop, its alone reference, the
staleness bound, and samples that roam to an idle group."""

from __future__ import annotations

import pytest

from plexrl.messages import Function
from plexrl.policy import PendingCall
from plexrl_sim.dedicated import alone_step_s
from plexrl_sim.executor import SimulationError
from plexrl_sim.multiplexed import MultiplexedSim
from plexrl_sim.run import policy_config, prepare, run_deployment
from tests.sim_fixtures import small_trace, two_jobs_one_worker, write_workload

_FB, _OPTIM = Function.FORWARD_BACKWARD, Function.OPTIM_STEP


def _one_job(staleness: int, mode: str = "run") -> dict:
    doc = small_trace(jobs=1)
    doc["trace"]["mix"] = {"small": 1.0}
    doc["cluster"]["groups"] = {"small": 1}
    doc["cluster"]["colocation"] = {"contention_while": mode}
    for profile in doc["profiles"].values():
        profile["staleness"] = staleness
    return doc


@pytest.mark.parametrize("mode", ["run", "shared"])
@pytest.mark.parametrize("name", ["plexrl+tail", "plexrl"])
def test_an_asynchronous_job_alone_runs_as_its_reference(tmp_path, mode, name):
    # The job alone on its group, run by the simulator, takes exactly the seconds of its
    # alone reference (the one-job loop of `dedicated`): the slowdown reference is the
    # job's own run, not an approximation of it.
    setup = prepare(write_workload(tmp_path, _one_job(1, mode)), seed=1)
    job = run_deployment(setup, name).jobs[0]
    released = name.endswith("+tail")
    steps = setup.factory.with_tail_release(0.25 if released else None).steps(setup.jobs[0])
    costs = setup.workload.cluster.colocation.costs()
    reference = alone_step_s(steps, costs, waits=released)
    # Its training waits out its own stragglers where its figures say its next rollout
    # starts sooner so (`plexrl.policy.defer`), in both.
    assert job.step_time_s == pytest.approx(reference, rel=1e-9)
    if released and mode == "run":
        assert alone_step_s(steps, costs) > 1.01 * reference
    assert job.slowdown >= -1e-9  # its reference is the fastest of the engines


def _lanes(**profile: object) -> dict:
    # One job on one worker: sample 2 s, reward 5 s, training 4 s, host-side gap 1 s.
    doc = two_jobs_one_worker()
    doc["profiles"]["p"].update({"reward_s": 5.0, "train_s": 4.0, "misc_s": 1.0, **profile})
    doc["jobs"] = [{"id": "A", "profile": "p", "steps": 3}]
    return doc


def test_an_asynchronous_job_samples_its_next_rollout_while_it_trains(tmp_path):
    # Synchronous: 3 x (2 + 5 + 4 + 1) = 36 s. Staleness 1: rollout 0 [0,2] scored at 7;
    # sample 1 [7,9] before training 0 [9,13]; rollout 1 scored at 14; sample 2 [14,16],
    # training 1 [16,20] (its lane free at 14); rollout 2 scored at 21, training 2
    # [21,25], its gap to 26.
    sync = run_deployment(prepare(write_workload(tmp_path, _lanes())), "fifo").jobs[0]
    assert sync.step_time_s == pytest.approx(36.0)
    setup = prepare(write_workload(tmp_path, _lanes(staleness=1)))
    sim = MultiplexedSim(
        setup.factory,
        setup.jobs,
        setup.groups,
        policy_config(setup, "fifo", {}),
        setup.gpus,
        record_trail=True,
    )
    job = sim.run().jobs[0]
    assert job.step_time_s == pytest.approx(26.0)
    assert job.isolated_step_time_s == pytest.approx(26.0)
    s, t = Function.SAMPLE, Function.FORWARD_BACKWARD
    o, v = Function.OPTIM_STEP, Function.SAVE
    assert sim.trails()["A"] == [
        (0, Function.CREATE),
        (0, s),
        (1, s),
        (0, t), (0, o), (0, v),
        (2, s),
        (1, t), (1, o), (1, v),
        (2, t), (2, o), (2, v),
    ]  # fmt: skip


def test_staleness_bounds_how_far_rollouts_run_ahead_of_training(tmp_path):
    # Training (10 s) is slower than a rollout (2 + 1 s): with staleness 1, rollout k
    # waits for step k - 2's weights. Rollout 0 is scored at 3: sample 1 [3,5], then
    # training 0 [5,15]; rollout 1 is scored at 6, but sample 2 waits for save 0 at 15:
    # [15,17]; training 1 [17,27] (its lane free at 16), training 2 [28,38], gap to 39.
    doc = _lanes(staleness=1, reward_s=1.0, train_s=10.0)
    one = run_deployment(prepare(write_workload(tmp_path, doc)), "fifo").jobs[0]
    assert one.step_time_s == pytest.approx(39.0)
    # Staleness 2: sample 2 may start at 6, but the worker trains step 0 until 15; on
    # one worker the training, not the staleness, holds this job back.
    doc["profiles"]["p"]["staleness"] = 2
    two = run_deployment(prepare(write_workload(tmp_path, doc)), "fifo").jobs[0]
    assert two.step_time_s == pytest.approx(39.0)


def _roaming() -> dict:
    # Two workers. B trains in 5 s calls nearly all the time on w0; C, alone on w1 (which
    # holds one state), is in a long reward stall most of the time (its idle hint says
    # so after its first); A, homed beside B on w0, samples 2 s every 200 s or so.
    doc = two_jobs_one_worker()
    worker = dict(doc["workers"][0])
    doc["workers"].append({**worker, "id": "w1", "device_bytes": 10, "host_bytes": 0})
    p = doc["profiles"]["p"]
    doc["profiles"] = {
        "a": {**p, "rollout": {"sample_s": 2.0}, "reward_s": 200.0, "train_s": 1.0},
        "b": {**p, "rollout": {"sample_s": 1.0}, "reward_s": 0.5, "train_s": 20.0, "fb_calls": 4},
        "c": {**p, "rollout": {"sample_s": 1.0}, "reward_s": 500.0, "train_s": 1.0},
    }
    doc["profiles"]["a"]["staleness"] = 1
    doc["jobs"] = [
        {"id": "B", "profile": "b", "steps": 150},
        {"id": "C", "profile": "c", "steps": 5, "arrival_s": 0.1},
        {"id": "A", "profile": "a", "steps": 12, "arrival_s": 0.2},
    ]
    doc["policy"] = {"slowdown_budget": 100.0, "pack": False}
    return doc


def test_a_sample_roams_to_an_idle_group_while_its_home_is_busy(tmp_path):
    setup = prepare(write_workload(tmp_path, _roaming()))
    result = run_deployment(setup, "plexrl")
    jobs = {j.job_id: j for j in result.jobs}
    assert {jobs[j].group for j in "AB"} == {"w0"} and jobs["C"].group == "w1"
    assert jobs["A"].roamed > 0 and result.counts["roamed"] >= jobs["A"].roamed
    # A's roaming samples ran on w1, which charged them: A occupies part of w1's time.
    assert jobs["A"].occupied_gpu_s > 0
    held = sum(g.held_s * g.devices for g in result.groups)
    assert sum(j.occupied_gpu_s for j in result.jobs) == pytest.approx(held)
    stay = run_deployment(setup, "plexrl", overrides={"roam": False})
    assert stay.counts["roamed"] == 0
    assert {j.job_id: j for j in stay.jobs}["A"].step_time_s > jobs["A"].step_time_s


def test_sliced_training_yields_to_a_sample_at_its_next_slice(tmp_path):
    # A (asynchronous) trains in one 20 s forward_backward, run in 4 slices of 5 s; B's
    # sample arrives at 25 while A's second training runs [25,45]. The policy asks at
    # 25.05; the slice in progress ends at 30: B samples [30,32], A resumes [32,47].
    doc = two_jobs_one_worker()
    p = doc["profiles"].pop("p")
    doc["profiles"]["a"] = {
        **p,
        "rollout": {"sample_s": 1.0},
        "reward_s": 1.0,
        "train_s": 20.0,
        "staleness": 1,
        "fb_slices": 4,
    }
    doc["profiles"]["b"] = {**p, "rollout": {"sample_s": 2.0}, "reward_s": 3.0, "train_s": 1.0}
    doc["jobs"] = [
        {"id": "A", "profile": "a", "steps": 2},
        {"id": "B", "profile": "b", "steps": 2, "arrival_s": 0.5},
    ]
    doc["policy"] = {"slowdown_budget": 100.0, "pack": False}
    setup = prepare(write_workload(tmp_path, doc))
    sliced = run_deployment(setup, "plexrl")
    a, b = (next(j for j in sliced.jobs if j.job_id == x) for x in "AB")
    assert sliced.counts["preempted"] == 1
    assert (a.finish_s, b.finish_s) == pytest.approx((47.0, 48.0), abs=1e-5)
    whole = run_deployment(prepare(write_workload(tmp_path, doc), fb_slices=1), "plexrl")
    assert whole.counts["preempted"] == 0
    # Whole, B's sample waits for A's training: [45,47], and it trains after its 3 s.
    assert next(j for j in whole.jobs if j.job_id == "B").finish_s == pytest.approx(51.0, abs=1e-5)


def test_a_run_takes_its_jobs_next_calls_or_the_next_of_one_kind(tmp_path):
    # A job of staleness 2 may wait with its next sample (of saved weights) ahead of or
    # behind its training calls: a Run takes the next of its calls, or of its samples
    # (they go first), or of its training calls (while its sample roams elsewhere).
    setup = prepare(write_workload(tmp_path, _lanes(staleness=2)))
    sim = MultiplexedSim(
        setup.factory, setup.jobs, setup.groups, policy_config(setup, "plexrl", {}), setup.gpus
    )
    job = next(iter(sim.jobs.values()))
    fb, optim = (PendingCall(f"A/1/{n}", "A", f, 1.0) for n, f in (("fb", _FB), ("optim", _OPTIM)))
    sample = PendingCall("A/3/sample", "A", Function.SAMPLE, 2.0, portable=True)
    take = sim.executor._take
    for ids, left in ((["A/3/sample"], [fb, optim]), (["A/1/fb", "A/1/optim"], [sample])):
        job.pending = [fb, optim, sample]
        assert [c.request_id for c in take(job, ids)] == ids and job.pending == left
    job.pending = [sample, fb, optim]
    with pytest.raises(SimulationError, match="skips or reorders"):
        take(job, ["A/1/optim"])  # its training calls keep their order
    assert [c.request_id for c in take(job, ["A/1/fb"])] == ["A/1/fb"]
    assert job.pending == [sample, optim]

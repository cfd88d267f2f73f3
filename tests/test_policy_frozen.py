"""`quick_init`: the policy's frozen types build exactly as their dataclass would."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest

from plexrl.messages import Function, Tier
from plexrl.policy import (
    Admit,
    CallEstimates,
    ClusterSnapshot,
    JobView,
    Move,
    PendingCall,
    Prefetch,
    Reject,
    RejectReason,
    Run,
    SwapCosts,
    WorkerView,
)
from plexrl.policy.frozen import quick_init
from plexrl.policy.history import Described, Prior
from plexrl.policy.plexrl_policy import Figures

QUICK = (
    Admit,
    CallEstimates,
    Described,
    Figures,
    JobView,
    Move,
    PendingCall,
    Prefetch,
    Prior,
    Reject,
    Run,
    WorkerView,
)


def _reference(cls: type) -> type:
    """The same fields under the dataclass's own generated `__init__`."""
    fields = [(f.name, f.type, f) for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(cls.__name__, fields, frozen=True)


@pytest.mark.parametrize("cls", QUICK, ids=lambda c: c.__name__)
def test_same_parameters_and_defaults_as_the_dataclass(cls):
    ours = inspect.signature(cls).parameters
    ref = inspect.signature(_reference(cls)).parameters
    assert list(ours) == list(ref)
    for name, param in ours.items():
        assert param.kind == ref[name].kind
        if ref[name].default is inspect.Parameter.empty:
            assert param.default is inspect.Parameter.empty
        elif repr(ref[name].default) == "<factory>":
            assert repr(param.default) == "<factory>"
        else:
            assert param.default == ref[name].default


def test_built_objects_equal_the_dataclass_ones_and_stay_frozen():
    estimates = CallEstimates({Function.SAMPLE: 2.0})
    job = JobView("a", 10, home="g", tier=Tier.HOST, estimates=estimates, duty_cycle=0.3)
    assert vars(job) == vars(_reference(JobView)(**vars(job)))
    assert JobView("a", 10) == JobView(job_id="a", state_bytes=10)
    # A default factory gives each object its own value, as the dataclass's does.
    assert JobView("a", 1).estimates is not JobView("b", 1).estimates
    assert JobView("a", 1).estimates == CallEstimates()
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.home = "h"  # type: ignore[misc]
    assert dataclasses.replace(job, tier=Tier.DEVICE).tier == Tier.DEVICE
    assert pickle.loads(pickle.dumps(job)) == job
    run = Run("g", "a", ("r1",), (Move("b", Tier.HOST),), 1.0, 2.0)
    assert hash(run) == hash(Run("g", "a", ("r1",), (Move("b", Tier.HOST),), 1.0, 2.0))
    snapshot = ClusterSnapshot(
        now=1.0,
        workers={"g": WorkerView("g", 100, 100)},
        jobs={"a": job},
        pending=(PendingCall("r1", "a", Function.SAMPLE, 0.5),),
    )
    assert snapshot.swap == SwapCosts()
    assert snapshot.homed("g") == [job] and snapshot.calls_of("a")[0].request_id == "r1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.now = 2.0  # type: ignore[misc]
    assert Reject("a", RejectReason.TOO_LARGE, "x").reason is RejectReason.TOO_LARGE
    assert Prefetch("g", "a").evict == () and Admit("a", "g").worker_id == "g"


def test_refuses_what_it_cannot_copy():
    @dataclasses.dataclass(frozen=True)
    class Checked:
        x: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass
    class Mutable:
        x: int

    for cls in (Checked, Mutable):
        with pytest.raises(TypeError):
            quick_init(cls)


def test_a_snapshots_indexes_are_its_own_and_a_replaced_one_builds_its_own() -> None:
    a, b = JobView("a", 1, home="g"), JobView("b", 1, home="h")
    calls = (
        PendingCall("r1", "a", Function.SAMPLE, 0.5),
        PendingCall("r2", "b", Function.SAMPLE, 1.0),
    )
    snapshot = ClusterSnapshot(1.0, {}, {"a": a}, calls[:1])
    assert snapshot.homed_view("g") == [a] and list(snapshot.callers()) == ["a"]
    moved = dataclasses.replace(snapshot, jobs={"a": a, "b": b}, pending=calls)
    assert moved.homed_view("h") == [b] and list(moved.callers()) == ["a", "b"]
    assert snapshot.homed_view("h") == () and list(snapshot.callers()) == ["a"]
    # The indexes are caches, not part of what the snapshot is.
    assert moved == ClusterSnapshot(1.0, {}, {"a": a, "b": b}, calls)
    assert "_homes" not in repr(moved)

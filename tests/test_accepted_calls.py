"""What a gateway knows of the calls it accepted without asking Redis: only within the
subscription it noted them in, and within its bounds."""

from __future__ import annotations

from gateway_support import noop_completion

from plexrl.stores import FutureRecord
from plexrl_gateway.accepted import AcceptedCalls


def future(request_id: str) -> FutureRecord:
    return FutureRecord(request_id, "alice", "job", "noop", created_at=0.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_nothing_is_noted_while_no_subscription_holds() -> None:
    accepted = AcceptedCalls()
    accepted.note([future("r1")])
    assert not accepted.knows("r1") and len(accepted) == 0
    accepted.listening(1)
    accepted.note([future("r1")])
    assert accepted.future("r1") == future("r1")
    assert accepted.completion("r1") is None  # not completed: no notice came


def test_a_new_subscription_forgets_what_the_last_one_heard() -> None:
    accepted = AcceptedCalls()
    accepted.listening(1)
    accepted.note([future("r1"), future("r2")])
    accepted.hold(noop_completion("r1"), 100)
    assert accepted.completion("r1") is not None
    accepted.listening(None)  # lost: notices may have gone by unheard
    assert not accepted.knows("r1") and not accepted.knows("r2")
    accepted.listening(2)
    assert not accepted.knows("r1") and not accepted.knows("r2")
    assert accepted.held_bytes == 0


def test_a_completion_is_held_only_for_a_call_noted_here() -> None:
    accepted = AcceptedCalls()
    accepted.listening(1)
    accepted.hold(noop_completion("elsewhere"), 100)
    assert accepted.held_bytes == 0 and not accepted.knows("elsewhere")
    accepted.note([future("r1")])
    accepted.forget(["r1"])  # its acceptance did not write it
    accepted.hold(noop_completion("r1"), 100)
    assert accepted.held_bytes == 0 and not accepted.knows("r1")


def test_the_oldest_fall_out_by_count_bytes_and_age() -> None:
    clock = Clock()
    accepted = AcceptedCalls(max_calls=3, max_held_bytes=250, max_age_s=60, clock=clock)
    accepted.listening(1)
    accepted.note([future(f"r{i}") for i in range(4)])
    assert not accepted.knows("r0") and len(accepted) == 3
    for request_id in ("r1", "r2", "r3"):
        accepted.hold(noop_completion(request_id), 100)
    # 300 bytes held over a 250 budget: the first held falls out, call and all.
    assert not accepted.knows("r1") and accepted.knows("r2") and accepted.held_bytes == 200
    clock.now = 61
    assert not accepted.knows("r2")  # its records in Redis may have expired
    accepted.note([future("r9")])  # and noting sweeps the old ones out
    assert len(accepted) == 1 and accepted.held_bytes == 0

"""`plexrl status|jobs|workers|timeline|top|dlq` against the real gateway app over HTTP.

The gateway runs in a thread with real Redis; only Kafka is faked (its publisher records
what would be sent). Workers' heartbeats, the timeline and usage are written to Redis the
way the workers and the scheduler write them; dead letters the way a consumer's
`DeadLetters` records them.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
from gateway_support import FakePublisher, drop_cluster_keys, free_port, unique_cluster
from rich.console import Console
from typer.testing import CliRunner

from plexrl.dead_letters import DeadLetters
from plexrl.health import HttpServer
from plexrl.messages import (
    DeadLetter,
    DeadLetterReason,
    RankMemory,
    ResidentState,
    Tier,
    WorkerHeartbeat,
    encode,
)
from plexrl.settings import GatewaySettings
from plexrl.stores import Residency, Stores, TimelineEntry
from plexrl_gateway.app import build_app
from plexrl_gateway.components import Gateway
from plexrl_tools.cli import app
from plexrl_tools.cli_status import (
    Snapshot,
    gantt,
    human_bytes,
    human_duration,
    jobs_table,
    parse_duration,
    sharing_line,
    totals,
)

KEY = "tml-alice"
runner = CliRunner()


@dataclass
class Served:
    url: str
    settings: GatewaySettings
    jobs: list[str]
    """Two LoRA models of tenant alice, oldest first."""
    samplers: list[str]
    """Two sampler sessions of tenant alice over the base model, never used."""


def run_gateway(settings: GatewaySettings, port: int, ready: threading.Event) -> None:
    """The gateway app in its own loop, until the module's tests are done."""

    async def main() -> None:
        stores = Stores.from_url(settings.redis_url, settings.cluster_id, settings.record_ttl_s)
        gateway = Gateway.build(settings, stores, FakePublisher())
        http = HttpServer(build_app(gateway), "127.0.0.1", port)
        await http.start()
        stop = asyncio.Event()
        SERVERS[port] = (asyncio.get_running_loop(), stop)
        ready.set()
        await stop.wait()
        await http.stop()
        await gateway.close()
        await drop_cluster_keys(stores, settings.cluster_id)
        await stores.close()

    asyncio.run(main())


SERVERS: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}


def create_model(http: httpx.Client) -> str:
    body = {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"}
    session = http.post("/api/v1/create_session", json=body).json()["session_id"]
    model = {
        "session_id": session,
        "model_seq_id": 0,
        "base_model": "plexrl/tiny-qwen3",
        "lora_config": {"rank": 8, "train_unembed": True},
        "type": "create_model",
    }
    response = http.post("/api/v1/create_model", json=model)
    assert response.status_code == 200, response.text
    return str(response.json()["model_id"])


def create_samplers(http: httpx.Client, n: int) -> list[str]:
    body = {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"}
    session = http.post("/api/v1/create_session", json=body).json()["session_id"]
    samplers = []
    for seq in range(n):
        sampler = {
            "session_id": session,
            "sampling_session_seq_id": seq,
            "base_model": "plexrl/tiny-qwen3",
            "type": "create_sampling_session",
        }
        response = http.post("/api/v1/create_sampling_session", json=sampler)
        assert response.status_code == 200, response.text
        samplers.append(str(response.json()["sampling_session_id"]))
    return samplers


async def dead_letter(stores: Stores, cluster_id: str, offset: int, call: dict[str, str]) -> None:
    """A request a consumer could not read (its schema is from the future), set aside."""
    letter = DeadLetter(
        source_topic="plexrl.requests",
        partition=0,
        offset=offset,
        key=None,
        reason=DeadLetterReason.UNSUPPORTED_VERSION,
        detail="schema_version 99 is newer than this reader (1)",
        value=msgspec.msgpack.encode({**call, "schema_version": 99}),
        consumer="scheduler-requests",
        at=time.time() - 100 + offset,
    )
    await DeadLetters(stores.calls, stores.keys, FakePublisher(), "plexrl.completions")(letter)


async def seed(settings: GatewaySettings, jobs: list[str]) -> None:
    """Two workers' heartbeats (worker-1 a group of 2 ranks); job 0 trained on worker-0 (a
    swap-in first), job 1 idle; two of alice's requests and one of bob's dead-lettered."""
    stores = Stores.from_url(settings.redis_url, settings.cluster_id, settings.record_ttl_s)
    now = time.time()
    try:
        residents = {"worker-0": [ResidentState(jobs[0], Tier.DEVICE, 3 << 20, 2)], "worker-1": []}
        for worker, resident in residents.items():
            ranks = 2 if worker == "worker-1" else 1
            beat = WorkerHeartbeat(
                worker_id=worker,
                device="cpu",
                device_bytes=ranks * (64 << 20),
                host_bytes=1 << 30,
                base_models=["plexrl/tiny-qwen3"],
                resident=resident,
                busy=False,
                started_at=now - 100,
                sent_at=now,
                devices=ranks,
                ranks=[RankMemory(r, "cpu", 64 << 20, (1 << 20) * ranks, 0) for r in range(ranks)],
            )
            await stores.workers.put_worker(worker, encode(beat), ttl_s=600)
        await stores.residency.cas_residency(
            jobs[0], 0, Residency("worker-0", Tier.DEVICE, 3 << 20, 1, now)
        )
        await stores.jobs.set_home(jobs[0], "worker-0")
        t = now - 40
        for i in range(3):
            for function, offset in (("forward_backward", 0.0), ("optim_step", 2.0)):
                entry = TimelineEntry(
                    worker_id="worker-0",
                    job_id=jobs[0],
                    request_id=f"r{i}-{function}",
                    function=function,
                    started_at=t + 10 * i + offset,
                    swap_s=0.5 if i == 0 and offset == 0 else 0.0,
                    compute_s=1.5,
                    ok=True,
                )
                await stores.timeline.append_timeline(entry)
        await stores.usage.add_usage(jobs[0], {"calls": 6.0, "device_s": 9.5})
        await stores.usage.mark_active(jobs[0], t)
        await stores.usage.mark_active(jobs[0], t + 23.5)
        for offset, request_id, tenant in ((41, "dead-1", "alice"), (42, "dead-2", "alice")):
            call = {"request_id": request_id, "job_id": jobs[0], "tenant": tenant}
            await dead_letter(stores, settings.cluster_id, offset, call)
        bobs = {"request_id": "dead-bob", "job_id": "bob-job", "tenant": "bob"}
        await dead_letter(stores, settings.cluster_id, 43, bobs)
    finally:
        await stores.close()


@pytest.fixture(scope="module")
def served(infra: dict[str, str], tiny_registry: Path) -> Iterator[Served]:
    settings = GatewaySettings(
        cluster_id=unique_cluster("cli"),
        kafka_bootstrap=infra["kafka"],
        redis_url=infra["redis"],
        api_keys=f"{KEY}=alice,tml-bob=bob",
        model_registry=tiny_registry,
        scheduler_url="http://127.0.0.1:9",
        state_store_url="http://127.0.0.1:9",
    )
    port = free_port()
    ready = threading.Event()
    thread = threading.Thread(target=run_gateway, args=(settings, port, ready), daemon=True)
    thread.start()
    assert ready.wait(60), "the gateway did not start"
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=60) as http:
            jobs = [create_model(http), create_model(http)]
            samplers = create_samplers(http, 2)
        asyncio.run(seed(settings, jobs))
        yield Served(url, settings, jobs, samplers)
    finally:
        loop, stop = SERVERS.pop(port)
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


def cli(served: Served, *args: str, key: str = KEY) -> str:
    result = runner.invoke(app, [*args, "--url", served.url, "--key", key], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_status_sums_the_jobs_and_reads_the_scheduler(served: Served) -> None:
    out = cli(served, "status")
    # Sampler sessions are not training jobs: counted on a line of their own.
    assert "workers" in out and "training jobs" in out and "2 live, 2 in all" in out
    assert "sampler sessions" in out and "0 sampled in the last 5m 00s, 2 in all" in out
    assert "unreachable" in out  # no scheduler in this test: said so, not a crash
    # 9.5 device-s used against 23.5 s of holding one device: 59.6% saved.
    assert "9.5 used / 23.5 dedicated" in out and "59.6%" in out
    data = json.loads(cli(served, "status", "--json"))
    assert data["totals"]["jobs"] == 2 and data["totals"]["live_jobs"] == 2
    assert data["totals"]["sampler_sessions"] == 2
    assert data["totals"]["active_sampler_sessions"] == 0
    assert data["totals"]["savings_fraction"] == pytest.approx(1 - 9.5 / 23.5)


def test_jobs_show_tier_steps_and_savings(served: Served) -> None:
    out = cli(served, "jobs")
    first, second = served.jobs
    assert "J1" in out and "J2" in out
    row = next(line for line in out.splitlines() if "J1" in line)
    assert "worker-0" in row and "device" in row and "@" not in row  # resident at home
    assert "3.0 MiB" in row and "59.6%" in row
    assert "6.0" in out  # 2 steps over 20 s: 6 steps/min
    rows = {j["job"]["job_id"]: j for j in json.loads(cli(served, "jobs", "--json"))}
    assert rows[first]["activity"]["steps"] == 3 and rows[first]["activity"]["swaps"] == 1
    assert rows[first]["home"] == "worker-0" and rows[second]["activity"]["steps"] == 0


def test_workers_show_residents_and_heartbeats(served: Served) -> None:
    out = cli(served, "workers")
    assert "worker-0" in out and "worker-1" in out
    assert "1 device" in out and "3.0 MiB / 64.0 MiB" in out and "ago" in out
    # A group's size, and each rank's share on its device.
    assert "cpu ×2" in out and "2.0 MiB · 2.0 MiB of 64.0 MiB each" in out
    data = json.loads(cli(served, "workers", "--json"))
    assert [w["worker_id"] for w in data] == ["worker-0", "worker-1"]


def test_timeline_draws_each_worker_and_lists_calls(served: Served) -> None:
    out = cli(served, "timeline", "--window", "2m")
    assert "worker-0" in out and "worker-1" in out
    assert "█" in out and "▒" in out  # compute and the first call's swap-in
    assert out.count("optim_step") == 3 and "500 ms" in out
    data = json.loads(cli(served, "timeline", "--json"))
    assert {e["job_id"] for e in data} == {served.jobs[0]}


def test_top_refreshes_in_place(served: Served) -> None:
    out = cli(served, "top", "--count", "2", "--interval", "0.2")
    assert "Jobs" in out and "Workers" in out and "Timeline" in out


def test_dlq_lists_this_keys_dead_letters_newest_first(served: Served) -> None:
    out = cli(served, "dlq")
    assert "Dead letters (2, newest first)" in out
    assert "plexrl.requests[0]@42" in out and "plexrl.requests[0]@41" in out
    assert out.index("@42") < out.index("@41")
    assert "unsupported_version" in out and "scheduler-requests" in out
    assert "@43" not in out  # bob's
    assert "answered with an error and not run" in out
    data = json.loads(cli(served, "dlq", "--json"))
    assert [e["offset"] for e in data] == [42, 41]
    assert data[0]["request_ids"] == ["dead-2"] and data[0]["job_ids"] == [served.jobs[0]]
    assert data[0]["tenant"] == "alice" and data[0]["reason"] == "unsupported_version"
    assert [e["offset"] for e in json.loads(cli(served, "dlq", "--json", "--limit", "1"))] == [42]
    (bobs,) = json.loads(cli(served, "dlq", "--json", key="tml-bob"))
    assert bobs["request_ids"] == ["dead-bob"]


def test_dlq_errors_are_one_line(served: Served) -> None:
    refused = runner.invoke(app, ["dlq", "--url", served.url, "--key", "tml-nope"])
    assert refused.exit_code == 1
    (line,) = refused.output.strip().splitlines()
    assert "refused the API key" in line
    url = f"http://127.0.0.1:{free_port()}"
    gone = runner.invoke(app, ["dlq", "--url", url, "--key", KEY, "--json"])
    assert gone.exit_code == 1
    (line,) = gone.output.strip().splitlines()
    assert f"cannot reach the gateway at {url}" in line


def test_a_refused_key_is_one_line_that_says_what_to_do(served: Served) -> None:
    result = runner.invoke(app, ["jobs", "--url", served.url, "--key", "tml-nope"])
    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()
    assert "refused the API key" in line and "PLEXRL_API_KEY" in line


def test_an_unreachable_gateway_is_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = runner.invoke(app, ["status", "--url", url, "--key", KEY])
    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()
    assert f"cannot reach the gateway at {url}" in line and "--url" in line


def test_url_and_key_come_from_the_environment(served: Served) -> None:
    env = {"PLEXRL_GATEWAY_URL": served.url, "TINKER_API_KEY": KEY, "COLUMNS": "200"}
    result = runner.invoke(app, ["workers", "--json"], env=env)
    assert result.exit_code == 0, result.output
    missing = runner.invoke(app, ["workers"], env={"PLEXRL_API_KEY": "", "TINKER_API_KEY": ""})
    assert missing.exit_code == 1 and "no API key" in missing.output


# Rendering, without a gateway --------------------------------------------------------------


def test_human_units() -> None:
    assert [human_duration(s) for s in (0.25, 12.34, 125, 3725)] == [
        "250 ms",
        "12.3 s",
        "2m 05s",
        "1h 02m",
    ]
    assert [human_bytes(n) for n in (512, 3 << 20, 1536 << 20)] == ["512 B", "3.0 MiB", "1.5 GiB"]
    assert [parse_duration(t) for t in ("90", "90s", "5m", "1h")] == [90, 90, 300, 3600]
    with pytest.raises(Exception, match="not a duration"):
        parse_duration("soon")


def render(table: object) -> str:
    console = Console(width=200, color_system=None)
    with console.capture() as captured:
        console.print(table)
    return captured.get()


def job_view(
    job_id: str, device_s: float, dedicated: float, kind: str = "training", calls: int = 0
) -> dict[str, object]:
    return {
        "job": {
            "job_id": job_id,
            "kind": kind,
            "unloaded": False,
            "spec": {"base_model": "m", "lora": None, "state_bytes": 10},
        },
        "home": None,
        "residency": None,
        "accounting": {
            "calls": 1,
            "device_s": device_s,
            "dedicated_device_s": dedicated,
            "savings_fraction": None,
        },
        "activity": {
            "calls": calls,
            "steps": 0,
            "steps_per_min": None,
            "swaps": 0,
            "last_at": None,
        },
    }


def test_gantt_gives_each_slice_to_the_job_that_held_it_longest() -> None:
    snap = Snapshot(
        cluster={},
        workers=[{"worker_id": "w0"}, {"worker_id": "w1"}],
        jobs=[job_view("a", 1, 2), job_view("b", 1, 2)],
        timeline=[
            # a: 1 s swap-in then 3 s compute; b: 2 s compute just after; w1 idle.
            {"worker_id": "w0", "job_id": "a", "started_at": 100, "swap_s": 1, "compute_s": 3},
            {"worker_id": "w0", "job_id": "b", "started_at": 104, "swap_s": 0, "compute_s": 2},
        ],
        window_s=10,
        taken_at=110,
    )
    lines = render(gantt(snap, width=10)).splitlines()
    w0 = next(line for line in lines if "w0" in line)
    w1 = next(line for line in lines if "w1" in line)
    assert "▒█████····" in w0  # one slice per second: swap, compute of a, then b
    assert "··········" in w1


def test_totals_and_a_job_with_no_history() -> None:
    jobs = [job_view("a", 2.0, 8.0), job_view("b", 1.0, 0.0)]
    assert totals(jobs)["savings_fraction"] == pytest.approx(1 - 3 / 8)
    assert totals([])["savings_fraction"] is None
    # One training job sampled through many sessions is one job, not twenty-two.
    samplers = [job_view(f"s{i}", 0.5, 1.0, kind="sampling", calls=i % 2) for i in range(21)]
    sums = totals([job_view("train", 2.0, 8.0), *samplers])
    assert (sums["jobs"], sums["live_jobs"]) == (1, 1)
    assert (sums["sampler_sessions"], sums["active_sampler_sessions"]) == (21, 10)
    assert sums["device_s"] == pytest.approx(2.0 + 21 * 0.5)  # all of them use devices
    snap = Snapshot({}, [], jobs, [], 300, time.time())
    out = render(jobs_table(snap))
    assert "J1 a" in out and "J2 b" in out and "–" in out


def test_the_costs_of_sharing_say_whence() -> None:
    set_ = {"switch_s": 1.0, "tail_min_share": 0.25, "tail_contention": 1.25}
    measured = {"switch_s": 0.0012, "tail_min_share": 0.15, "tail_contention": 6.7}
    assert sharing_line({"predicted": set_, "set": set_}) == (
        "switch 1000.0 ms, stragglers hold >= 25% and decode 1.25x slower beside a call (as set)"
    )
    line = sharing_line({"predicted": measured, "set": set_})
    assert line is not None and line.startswith("switch 1.2 ms, stragglers hold >= 15%")
    assert line.endswith("6.70x slower beside a call (as the workers measured)")
    assert sharing_line(None) is None  # an older scheduler says nothing of them
    # A worker whose group is predicted with its own figures is named with them.
    apart = {"predicted": measured, "set": set_, "workers": {"gpu-7": set_}}
    line = sharing_line(apart)
    assert line is not None and "(as the workers measured); on gpu-7: switch 1000.0 ms" in line

"""A session's calls as a Perfetto trace: `tinker session export-trace`.

The trace is read back with the protobuf library against Perfetto's own field numbers
(tests.perfetto_schema); live, the SDK's own CLI exports a session that trained and
sampled on the shared cluster, and the signed URL is refused when altered or asked by
another tenant.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import tinker
from gateway_harness import ALICE, gateway
from tinker import types

from plexrl.stores.jobs import JobKind, JobRecord, JobSpec
from plexrl.stores.timeline import TimelineEntry
from plexrl_gateway.session_trace import session_trace, track_uuid
from plexrl_tools.cluster import LocalCluster
from tests import perfetto_schema
from tests.sdk_support import tinker_cli

KEY = "tml-trace"
OTHER_KEY = "tml-trace-other"
BASE = "plexrl/tiny-qwen3"


def _job(job_id: str, kind: JobKind, session: str = "s1", at: float = 0.0) -> JobRecord:
    return JobRecord(
        job_id=job_id,
        tenant="t",
        kind=kind,
        spec=JobSpec(base_model=BASE),
        created_at=at,
        session_id=session,
    )


def _entry(
    job: str,
    rid: str,
    function: str,
    at: float,
    swap: float,
    compute: float,
    queued: float = 0.0,
) -> TimelineEntry:
    return TimelineEntry(
        worker_id="w0",
        job_id=job,
        request_id=rid,
        function=function,
        started_at=at,
        swap_s=swap,
        compute_s=compute,
        ok=True,
        queue_s=queued,
    )


def test_each_call_is_a_slice_on_its_jobs_track_its_swap_first_its_wait_beside() -> None:
    train, sampler = "s1:train:0", "s1:sample:0"
    jobs = [_job(train, JobKind.TRAINING), _job(sampler, JobKind.SAMPLING, at=1.0)]
    t0 = 1_764_000_000.0
    entries = [
        _entry(train, "r1", "forward_backward", t0, 0.5, 2.0),
        _entry(train, "r1", "forward_backward", t0, 0.5, 2.0),  # a retried write
        _entry("other:train:0", "x1", "optim_step", t0 + 1, 0.0, 1.0),  # not the session's
        _entry(train, "r2", "optim_step", t0 + 3.0, 0.0, 0.25, queued=2.5),  # sent beside r1
        _entry(sampler, "r3", "sample", t0 + 1.0, 0.0, 4.0),
        _entry(sampler, "r4", "sample", t0 + 2.0, 0.0, 1.0),  # beside r3: a lane of its own
    ]
    trace = perfetto_schema.parse(session_trace("s1", jobs, entries))
    tracks = perfetto_schema.tracks(trace)
    root = track_uuid("session", "s1")
    assert tracks[root] == ("session s1: 4 calls", 0)
    assert tracks[track_uuid("job", train)] == (f"{train} (training run)", root)
    assert tracks[track_uuid("job", sampler)] == (f"{sampler} (sampler)", root)
    assert tracks[track_uuid("job", sampler, "1")] == (f"{sampler} (sampler) 2", root)
    assert tracks[track_uuid("queued", train)] == (f"{train} queued", root)
    assert len(tracks) == 5  # no queued track for the sampler, which never waited
    got = sorted(
        (s["start"], s["name"], s["end"], s["track"], s["args"].get("request_id"))
        for s in perfetto_schema.slices(trace)
    )

    def ns(seconds: float) -> int:  # as the trace rounds wall-clock seconds
        return round((t0 + seconds) * 1e9)

    tr, sa = track_uuid("job", train), track_uuid("job", sampler)
    assert got == [
        (ns(0), "swap in", ns(0.5), tr, "r1"),
        (ns(0.5), "forward_backward", ns(0.5 + 2.0), tr, "r1"),
        (ns(3.0 - 2.5), "queued", ns(3.0), track_uuid("queued", train), "r2"),
        (ns(1.0), "sample", ns(1.0 + 4.0), sa, "r3"),
        (ns(2.0), "sample", ns(2.0 + 1.0), track_uuid("job", sampler, "1"), "r4"),
        (ns(3.0), "optim_step", ns(3.0 + 0.25), tr, "r2"),
    ]
    fb = next(s for s in perfetto_schema.slices(trace) if s["name"] == "forward_backward")
    assert fb["args"] == {
        "request_id": "r1",
        "worker": "w0",
        "ok": True,
        "queue_s": 0.0,
        "swap_s": 0.5,
        "compute_s": 2.0,
    }
    assert fb["categories"] == ["plexrl"]


def test_a_session_without_calls_is_its_tracks_alone() -> None:
    trace = perfetto_schema.parse(session_trace("s2", [_job("s2:train:0", JobKind.TRAINING)], []))
    assert len(perfetto_schema.tracks(trace)) == 2
    assert perfetto_schema.slices(trace) == []


async def test_a_trace_url_past_its_expiry_is_gone_and_an_unknown_session_has_none(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    async with gateway(infra, tiny_registry, export_url_ttl_s=1.0) as gw:
        session = (await gw.ok("create_session", {"tags": [], "sdk_version": "0.38.0"}))[
            "session_id"
        ]
        answer = await gw.http.get(f"/api/v1/sessions/{session}/trace_export", headers=ALICE)
        assert answer.status_code == 200, answer.text
        url = answer.json()["url"]
        fresh = await gw.http.get(url)  # no key: the signature is the permission
        assert fresh.status_code == 200
        assert perfetto_schema.slices(perfetto_schema.parse(fresh.content)) == []
        await asyncio.sleep(1.5)
        expired = await gw.http.get(url)
        assert expired.status_code == 410 and "export_session_trace" in expired.json()["error"]
        unknown = await gw.http.get("/api/v1/sessions/sess-none/trace_export", headers=ALICE)
        assert unknown.status_code == 404


# Live: the SDK's CLI against the shared cluster ------------------------------------------


@pytest.fixture(scope="module")
def cluster(shared_services: LocalCluster) -> LocalCluster:
    return shared_services


def _cli(cluster: LocalCluster, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    return tinker_cli(cluster.config.gateway_url, key, *args)


@pytest.fixture(scope="module")
def session(cluster: LocalCluster) -> tuple[str, dict[str, str]]:
    """A session that trained a step and sampled: its id, and each call's function by
    job (what the trace must show)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    service = tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=KEY)
    trainer = service.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([3, 5, 7, 9]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=[5, 7, 9, 11], dtype="int64"),
            "weights": types.TensorData(data=[1.0] * 4, dtype="float32"),
        },
    )
    trainer.forward_backward([datum], "cross_entropy").result(timeout=120)
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
    sampling = trainer.save_weights_and_get_sampling_client().result(timeout=120)
    sampling.sample(
        types.ModelInput.from_ints([3, 5]), 1, types.SamplingParams(max_tokens=2, seed=1)
    ).result(timeout=120)
    model_id = trainer.get_info().model_id
    return model_id.split(":")[0], {"train": model_id}


def test_the_tinker_cli_exports_the_sessions_calls_as_a_perfetto_trace(
    cluster: LocalCluster, session: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    session_id, ids = session
    out = tmp_path / "s.pftrace"
    done = _cli(cluster, KEY, "session", "export-trace", session_id, "--output", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    trace = perfetto_schema.parse(out.read_bytes())
    tracks = perfetto_schema.tracks(trace)
    by_track: dict[str, set[str]] = {}
    for s in perfetto_schema.slices(trace):
        by_track.setdefault(tracks[s["track"]][0], set()).add(s["name"])
        assert s["end"] >= s["start"]
    # A sampler over the run's own weights samples as the run (its home, its state).
    train_track = f"{ids['train']} (training run)"
    assert {"create", "forward_backward", "optim_step", "save", "sample"} <= by_track[train_track]
    assert any(name.endswith("(sampler)") for name, _ in tracks.values())
    assert "queued" in by_track[f"{ids['train']} queued"]  # Kafka and the scheduler, at least


def test_the_trace_url_is_refused_when_altered_and_the_session_to_other_tenants(
    cluster: LocalCluster, session: tuple[str, dict[str, str]]
) -> None:
    session_id, _ = session
    done = _cli(cluster, KEY, "session", "export-trace", session_id, "--url-only")
    assert done.returncode == 0, done.stdout + done.stderr
    url: str = json.loads(done.stdout)["url"]
    assert httpx.get(url, timeout=60).status_code == 200  # no key needed
    altered = httpx.get(url.replace("signature=", "signature=0"), timeout=60)
    assert altered.status_code == 403
    assert "export_session_trace" in altered.json()["error"]
    other = _cli(cluster, OTHER_KEY, "session", "export-trace", session_id, "--url-only")
    assert other.returncode != 0
    assert "404" in other.stdout + other.stderr

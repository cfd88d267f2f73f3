"""`plexrl status|jobs|workers|timeline|top|dlq`: the cluster as an operator sees it.

Every command reads the gateway's `/plexrl/v1` API with an API key, like the web
dashboard, and shows what that key may see: rich tables with human times, or `--json`
for scripts.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import httpx
import typer
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.table import Table
from rich.text import Text

DEFAULT_URL = "http://127.0.0.1:8000"
# The dashboard's palette (static/dashboard.js), so a job looks the same in both.
PALETTE = (
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
    "#b07aa1", "#ff9da7", "#9c755f", "#86bcb6", "#d37295", "#a0cbe8",
)  # fmt: skip
OTHER_COLOUR = "#bab0ac"
# A heartbeat older than this means the worker is probably gone (workers beat every ~1 s).
STALE_HEARTBEAT_S = 15.0
# Terminals at least this wide get every column of the jobs table.
WIDE_COLUMNS = 150


T = TypeVar("T")


class GatewayError(Exception):
    """One line that says what went wrong and what to change."""


class GatewayClient:
    """GET on the gateway's `/plexrl/v1` API, with errors turned into one-line reasons."""

    def __init__(self, url: str, key: str, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers={"X-API-Key": key}, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def get(self, path: str, **params: Any) -> Any:
        try:
            response = self._http.get(f"/plexrl/v1{path}", params=params)
        except httpx.TransportError as exc:
            reason = str(exc) or type(exc).__name__
            raise GatewayError(
                f"cannot reach the gateway at {self.url} ({reason}); start it "
                "(`plexrl serve gateway`) or point --url / PLEXRL_GATEWAY_URL at it"
            ) from exc
        if response.status_code == 401:
            raise GatewayError(
                f"the gateway at {self.url} refused the API key ({_error_text(response)}); "
                "pass --key or set PLEXRL_API_KEY to a key in the gateway's PLEXRL_API_KEYS"
            )
        if response.status_code >= 400:
            raise GatewayError(
                f"GET /plexrl/v1{path} at {self.url} answered {response.status_code}: "
                f"{_error_text(response)}"
            )
        try:
            return response.json()
        except ValueError as exc:
            raise GatewayError(
                f"{self.url}/plexrl/v1{path} did not answer JSON; is --url a PlexRL gateway?"
            ) from exc


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200] or response.reason_phrase
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    return str(body)[:200]


@dataclass(frozen=True)
class Snapshot:
    """What one refresh read from the gateway."""

    cluster: dict[str, Any]
    workers: list[dict[str, Any]]
    jobs: list[dict[str, Any]]
    """`/jobs?details=true`: record, home, residency, accounting, activity."""
    timeline: list[dict[str, Any]]
    window_s: float
    taken_at: float


def read_snapshot(client: GatewayClient, window_s: float, clock: Callable[[], float]) -> Snapshot:
    now = clock()
    return Snapshot(
        cluster=client.get("/cluster"),
        workers=client.get("/workers"),
        jobs=client.get("/jobs", details="true", window_s=window_s),
        timeline=client.get("/timeline", since=max(0.0, now - window_s), limit=10000),
        window_s=window_s,
        taken_at=now,
    )


# Human formatting ------------------------------------------------------------------------


def human_duration(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "–"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes}m {int(seconds % 60):02d}s"
    return f"{minutes // 60}h {minutes % 60:02d}m"


def human_ago(at: float | None, now: float) -> str:
    return "–" if at is None else f"{human_duration(max(0.0, now - at))} ago"


def human_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.1f} {unit}"


def human_pct(fraction: float | None) -> str:
    return "–" if fraction is None else f"{fraction * 100:.1f}%"


def clock_time(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def parse_duration(text: str) -> float:
    """`90`, `90s`, `5m`, `1h` → seconds."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    raw = text.strip().lower()
    scale = units.get(raw[-1:])
    number = raw[:-1] if scale is not None else raw
    try:
        seconds = float(number) * (scale or 1.0)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a duration; write e.g. 90s, 5m or 1h") from None
    if seconds <= 0:
        raise typer.BadParameter(f"{text!r} must be more than zero")
    return seconds


# Rendering --------------------------------------------------------------------------------


def job_labels(jobs: Iterable[Mapping[str, Any]]) -> dict[str, tuple[str, str]]:
    """Job id → (short label J1, J2, ..., colour), in creation order as the dashboard does."""
    return {
        j["job"]["job_id"]: (f"J{i + 1}", PALETTE[i % len(PALETTE)]) for i, j in enumerate(jobs)
    }


def short_id(job_id: str) -> str:
    """The end of a job id (`…4008:train:0`): the session prefix is the same for a
    client's jobs, the end tells them apart."""
    return job_id if len(job_id) <= 16 else f"…{job_id[-14:]}"


def is_sampler(job: Mapping[str, Any]) -> bool:
    """A sampler session (`create_sampling_client`), not a training job: a client makes
    many and never unloads them, so they are counted apart."""
    return bool(job["job"].get("kind") == "sampling")


def totals(jobs: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Training jobs and sampler sessions, and the device-seconds all of them used
    against dedicated devices, and the fraction saved."""
    jobs = list(jobs)
    training = [j for j in jobs if not is_sampler(j)]
    samplers = [j for j in jobs if is_sampler(j)]
    used = sum(j["accounting"]["device_s"] for j in jobs)
    dedicated = sum(j["accounting"]["dedicated_device_s"] for j in jobs)
    return {
        "jobs": len(training),
        "live_jobs": sum(1 for j in training if not j["job"]["unloaded"]),
        "sampler_sessions": len(samplers),
        "active_sampler_sessions": sum(
            1 for j in samplers if (j.get("activity") or {}).get("calls", 0) > 0
        ),
        "device_s": used,
        "dedicated_device_s": dedicated,
        "savings_fraction": (1.0 - used / dedicated) if dedicated > 0 else None,
    }


def status_table(snap: Snapshot, url: str) -> Table:
    sched = snap.cluster.get("scheduler") or {}
    sums = totals(snap.jobs)
    live = [w for w in snap.workers if "error" not in w]
    stale = sum(1 for w in live if w.get("age_s", 0) > STALE_HEARTBEAT_S)
    table = Table(title=f"PlexRL at {url}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row(
        "workers", f"{len(live)}" + (f" ({stale} not heard from lately)" if stale else "")
    )
    table.add_row("training jobs", f"{sums['live_jobs']} live, {sums['jobs']} in all")
    table.add_row(
        "sampler sessions",
        f"{sums['active_sampler_sessions']} sampled in the last "
        f"{human_duration(snap.window_s)}, {sums['sampler_sessions']} in all",
    )
    if sched.get("reachable"):
        inflight = sched.get("inflight") or {}
        table.add_row("queue depth", f"{sched.get('pending', 0)} calls waiting")
        table.add_row("running", f"{len(inflight)} calls" if inflight else "nothing")
        costs = sharing_line(sched.get("sharing"))
        if costs:
            table.add_row("costs of sharing", costs)
    else:
        table.add_row("scheduler", Text("unreachable", style="red"))
    table.add_row(
        "device-seconds",
        f"{sums['device_s']:.1f} used / {sums['dedicated_device_s']:.1f} dedicated",
    )
    table.add_row("savings so far", human_pct(sums["savings_fraction"]))
    return table


def sharing_line(sharing: dict[str, Any] | None) -> str | None:
    """The costs of sharing the scheduler's policy predicts with, and whence: its
    settings, or its workers' measurements; and the workers whose groups it predicts
    with their own figures."""
    predicted = (sharing or {}).get("predicted")
    if not predicted:
        return None
    source = "as set" if predicted == (sharing or {}).get("set") else "as the workers measured"
    line = f"{_costs_text(predicted)} ({source})"
    own = (sharing or {}).get("workers") or {}
    for worker_id, costs in own.items():
        line += f"; on {worker_id}: {_costs_text(costs)} (as it measured)"
    return line


def _costs_text(costs: dict[str, float]) -> str:
    return (
        f"switch {1000 * costs['switch_s']:.1f} ms, stragglers hold >= "
        f"{costs['tail_min_share']:.0%} and decode {costs['tail_contention']:.2f}x "
        "slower beside a call"
    )


def jobs_table(snap: Snapshot, wide: bool = True) -> Table:
    """One row per job; `wide=False` leaves out the model, state size, calls, swaps and
    the dedicated figure so the table fits a 100-column terminal."""
    labels = job_labels(snap.jobs)
    table = Table(title=f"Jobs (steps, rate, swaps: last {human_duration(snap.window_s)})")
    columns: list[tuple[str, JustifyMethod]] = [("job", "left"), ("model", "left")]
    columns += [("home", "left"), ("tier", "left")]
    columns += [("state", "right"), ("calls", "right"), ("steps", "right")]
    columns += [("steps/min", "right"), ("swaps", "right"), ("device-s", "right")]
    columns += [("dedicated", "right"), ("saved", "right"), ("last call", "left")]
    narrow_drop = {"model", "state", "calls", "swaps", "dedicated"}
    shown = [(n, j) for n, j in columns if wide or n not in narrow_drop]
    for name, justify in shown:
        table.add_column(name, justify=justify, no_wrap=name != "model")
    tier_styles = {"device": "green", "host": "yellow", "disk": "white"}
    for j in snap.jobs:
        job, acct, act, res = j["job"], j["accounting"], j["activity"], j["residency"]
        label, colour = labels[job["job_id"]]
        lora = job["spec"].get("lora")
        rate = act.get("steps_per_min")
        home = j.get("home")
        tier: Text = Text("–", style="dim")
        if res:
            # Where the state is, naming the worker only when it is not the job's home.
            away = "" if res["worker_id"] == home else f"@{res['worker_id']}"
            tier = Text(res["tier"] + away, style=tier_styles.get(res["tier"], ""))
        cells: dict[str, RenderableType] = {
            "job": Text.assemble(("■ ", colour), f"{label} {short_id(job['job_id'])}")
            + Text(" (unloaded)" if job["unloaded"] else "", "dim"),
            "model": job["spec"]["base_model"] + (f" LoRA r{lora['rank']}" if lora else " full"),
            "home": home or "–",
            "tier": tier,
            "state": human_bytes(res["bytes"] if res else job["spec"].get("state_bytes")),
            "calls": str(acct["calls"]),
            "steps": str(act["steps"]),
            "steps/min": "–" if rate is None else f"{rate:.1f}",
            "swaps": str(act["swaps"]),
            "device-s": f"{acct['device_s']:.2f}",
            "dedicated": f"{acct['dedicated_device_s']:.2f}",
            "saved": human_pct(acct.get("savings_fraction")),
            "last call": human_ago(act.get("last_at"), snap.taken_at),
        }
        table.add_row(*(cells[name] for name, _ in shown))
    return table


def workers_table(snap: Snapshot) -> Table:
    labels = job_labels(snap.jobs)
    inflight = (snap.cluster.get("scheduler") or {}).get("inflight") or {}
    table = Table(title="Workers")
    for name in ("worker", "device", "now", "resident states"):
        table.add_column(name)
    table.add_column("device tier", justify="right")
    table.add_column("host tier", justify="right")
    table.add_column("per rank (device)", justify="right")
    table.add_column("heartbeat")
    for w in snap.workers:
        if "error" in w:
            table.add_row(w["worker_id"], Text(w["error"], style="red"))
            continue
        running = inflight.get(w["worker_id"])
        if running:
            now = Text(f"running {labels.get(running, (short_id(running), ''))[0]}", "bold blue")
        else:
            now = Text("busy", "bold blue") if w.get("busy") else Text("idle", "dim")
        counts: dict[str, int] = {}
        used = {"device": 0, "host": 0}
        for r in w.get("resident", []):
            counts[r["tier"]] = counts.get(r["tier"], 0) + 1
            if r["tier"] in used:
                used[r["tier"]] += r["bytes"]
        age = w.get("age_s", 0.0)
        devices = w.get("devices", 1)
        table.add_row(
            w["worker_id"],
            w["device"] + (f" ×{devices}" if devices > 1 else ""),
            now,
            " · ".join(f"{n} {tier}" for tier, n in sorted(counts.items())) or "none",
            f"{human_bytes(used['device'])} / {human_bytes(w['device_bytes'])}",
            f"{human_bytes(used['host'])} / {human_bytes(w['host_bytes'])}",
            per_rank(w.get("ranks") or []),
            Text(f"{human_duration(age)} ago", "red" if age > STALE_HEARTBEAT_S else ""),
        )
    return table


def per_rank(ranks: list[dict[str, Any]]) -> str:
    """Each rank's job-state bytes on its device, of its capacity: a group's shards."""
    if not ranks:
        return "-"
    used = " · ".join(human_bytes(r["device_used"]) for r in ranks)
    return f"{used} of {human_bytes(ranks[0]['device_bytes'])} each"


def gantt(snap: Snapshot, width: int = 72) -> Table:
    """The timeline as text: one row per worker, one character per slice of the window,
    coloured by the job that held the worker longest in it; ▒ where that was a swap-in."""
    labels = job_labels(snap.jobs)
    start, end = snap.taken_at - snap.window_s, snap.taken_at
    cell = (end - start) / width
    rows = sorted({w["worker_id"] for w in snap.workers} | {e["worker_id"] for e in snap.timeline})
    # Per worker and slice: (seconds held, job, whether it was a swap-in).
    best: dict[str, list[tuple[float, str, bool]]] = {r: [(0.0, "", False)] * width for r in rows}
    for e in snap.timeline:
        swap_end = e["started_at"] + e["swap_s"]
        segments = ((e["started_at"], swap_end, True), (swap_end, swap_end + e["compute_s"], False))
        for a, b, swap in segments:
            first = max(0, int((a - start) // cell))
            last = min(width, math.ceil((b - start) / cell))
            for i in range(first, last):
                held = min(b, start + (i + 1) * cell) - max(a, start + i * cell)
                if held > best[e["worker_id"]][i][0]:
                    best[e["worker_id"]][i] = (held, e["job_id"], swap)
    table = Table(
        title=f"Timeline {clock_time(start)} → {clock_time(end)}",
        caption="█ compute  ▒ swap-in  · idle",
        caption_justify="left",
    )
    table.add_column("worker")
    table.add_column(f"{human_duration(snap.window_s)}", no_wrap=True)
    for row in rows:
        text = Text()
        for held, job_id, swap in best[row]:
            if held <= 0:
                text.append("·", "dim")
            else:
                colour = labels.get(job_id, ("", OTHER_COLOUR))[1]
                text.append("▒" if swap else "█", colour)
        table.add_row(row, text)
    return table


def chart_width(columns: int) -> int:
    """Characters of the timeline chart in a terminal `columns` wide (beside the names)."""
    return max(20, min(120, columns - 20))


def legend(snap: Snapshot) -> Text:
    seen = {e["job_id"] for e in snap.timeline}
    text = Text()
    for job_id, (label, colour) in job_labels(snap.jobs).items():
        if job_id in seen:
            text.append("■ ", colour).append(f"{label} {short_id(job_id)}   ")
    return text


def timeline_table(snap: Snapshot, limit: int) -> Table:
    labels = job_labels(snap.jobs)
    entries = sorted(snap.timeline, key=lambda e: e["started_at"])[-limit:]
    table = Table(title=f"Last {len(entries)} calls")
    for name in ("started", "worker", "job", "function"):
        table.add_column(name)
    for name in ("swap-in", "compute"):
        table.add_column(name, justify="right")
    table.add_column("ok")
    for e in entries:
        label, colour = labels.get(e["job_id"], (short_id(e["job_id"]), OTHER_COLOUR))
        table.add_row(
            clock_time(e["started_at"]),
            e["worker_id"],
            Text.assemble(("■ ", colour), label),
            e["function"],
            human_duration(e["swap_s"]) if e["swap_s"] > 0 else "",
            human_duration(e["compute_s"]),
            Text("yes", "green") if e["ok"] else Text("FAILED", "bold red"),
        )
    return table


def dlq_table(
    entries: Iterable[Mapping[str, Any]], now: float, wide: bool = True
) -> RenderableType:
    """One row per dead letter (`GET /plexrl/v1/dlq`), newest first: where the message
    was read, why it was set aside, and the calls it carried. `wide=False` leaves out
    the consumer and the jobs so the table fits a 100-column terminal."""
    entries = list(entries)
    if not entries:
        return Text("No dead letters: every message of this key's calls was read.")
    table = Table(
        title=f"Dead letters ({len(entries)}, newest first)",
        caption="Each call named was answered with an error and not run; send it again.",
        caption_justify="left",
    )
    columns = ["when", "message", "reason", "consumer", "jobs", "calls", "detail"]
    shown = [n for n in columns if wide or n not in ("consumer", "jobs")]
    for name in shown:
        table.add_column(
            name, justify="right" if name == "calls" else "left", no_wrap=name != "detail"
        )
    for e in entries:
        detail = e["detail"] if len(e["detail"]) <= 120 else e["detail"][:119] + "…"
        # Text, not str: ids and details are data, never rich markup or :emoji: codes.
        cells: dict[str, RenderableType] = {
            "when": human_ago(e["at"], now),
            "message": Text(f"{e['source_topic']}[{e['partition']}]@{e['offset']}"),
            "reason": Text(e["reason"], "red"),
            "consumer": Text(e["consumer"]),
            "jobs": Text(", ".join(short_id(j) for j in e.get("job_ids", [])) or "–"),
            "calls": str(len(e.get("request_ids", []))),
            "detail": Text(detail),
        }
        table.add_row(*(cells[name] for name in shown))
    return table


def top_view(snap: Snapshot, url: str, width: int, error: str | None = None) -> RenderableType:
    """Everything at once, laid out for a terminal `width` columns wide."""
    parts: list[RenderableType] = [status_table(snap, url), gantt(snap, chart_width(width))]
    parts += [legend(snap), jobs_table(snap, wide=width >= WIDE_COLUMNS), workers_table(snap)]
    footer = f"updated {clock_time(snap.taken_at)} · Ctrl-C to quit"
    if error:
        parts.append(Text(f"refresh failed: {error}", "bold red"))
    parts.append(Text(footer, "dim"))
    return Group(*parts)


# Commands ---------------------------------------------------------------------------------

Url = Annotated[
    str,
    typer.Option(
        "--url",
        envvar=["PLEXRL_GATEWAY_URL", "TINKER_BASE_URL"],
        help="The gateway's base URL.",
    ),
]
Key = Annotated[
    str | None,
    typer.Option(
        "--key",
        envvar=["PLEXRL_API_KEY", "TINKER_API_KEY"],
        help="An API key of the gateway (its tenant's jobs are shown).",
        show_default=False,
    ),
]
Json = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of tables.")]
Window = Annotated[
    str, typer.Option("--window", help="How far back the timeline and activity go: 90s, 5m, 1h.")
]


def _console() -> Console:
    return Console(soft_wrap=False)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)


def _client(url: str, key: str | None) -> GatewayClient:
    if not key:
        raise _fail("no API key: pass --key or set PLEXRL_API_KEY (or TINKER_API_KEY)")
    return GatewayClient(url, key)


def _read(url: str, key: str | None, read: Callable[[GatewayClient], T]) -> T:
    """`read` through a client of the gateway; its errors end the command in one line."""
    client = _client(url, key)
    try:
        return read(client)
    except GatewayError as exc:
        raise _fail(str(exc)) from None
    finally:
        client.close()


def _snapshot(url: str, key: str | None, window: str) -> Snapshot:
    window_s = parse_duration(window)
    return _read(url, key, lambda client: read_snapshot(client, window_s, time.time))


def _print_json(value: Any) -> None:
    import json

    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")


def status(url: Url = DEFAULT_URL, key: Key = None, json: Json = False) -> None:
    """The cluster at a glance: workers, jobs, queue depth, device-seconds and savings."""
    snap = _snapshot(url, key, "5m")
    if json:
        _print_json({"url": url, "cluster": snap.cluster, "totals": totals(snap.jobs)})
        return
    _console().print(status_table(snap, url))


def jobs(
    url: Url = DEFAULT_URL, key: Key = None, json: Json = False, window: Window = "5m"
) -> None:
    """Each job: home, residency tier, steps and step rate, device-seconds and savings."""
    snap = _snapshot(url, key, window)
    if json:
        _print_json(snap.jobs)
        return
    console = _console()
    console.print(jobs_table(snap, wide=console.width >= WIDE_COLUMNS))


def workers(url: Url = DEFAULT_URL, key: Key = None, json: Json = False) -> None:
    """Each worker: device, what it runs now, the job states resident in each tier."""
    snap = _snapshot(url, key, "5m")
    if json:
        _print_json(snap.workers)
        return
    _console().print(workers_table(snap))


def timeline(
    url: Url = DEFAULT_URL,
    key: Key = None,
    json: Json = False,
    window: Window = "5m",
    limit: Annotated[int, typer.Option(help="Calls listed under the chart.", min=0)] = 20,
) -> None:
    """Which job ran where and when: a chart per worker, then the latest calls."""
    snap = _snapshot(url, key, window)
    if json:
        _print_json(snap.timeline)
        return
    console = _console()
    console.print(gantt(snap, chart_width(console.width)))
    console.print(legend(snap))
    if limit:
        console.print(timeline_table(snap, limit))


def top(
    url: Url = DEFAULT_URL,
    key: Key = None,
    window: Window = "2m",
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.", min=0.2)] = 2.0,
    count: Annotated[
        int, typer.Option(help="Stop after this many refreshes (0: until Ctrl-C).", min=0)
    ] = 0,
) -> None:
    """A live view: status, the timeline chart, jobs and workers, refreshed in place."""
    from rich.live import Live

    window_s = parse_duration(window)
    client = _client(url, key)
    try:
        snap = read_snapshot(client, window_s, time.time)
    except GatewayError as exc:
        client.close()
        raise _fail(str(exc)) from None
    refreshes = 1
    try:
        console = _console()
        view = top_view(snap, url, console.width)
        with Live(view, console=console, auto_refresh=False) as live:
            live.refresh()
            while count == 0 or refreshes < count:
                time.sleep(interval)
                error = None
                try:
                    snap = read_snapshot(client, window_s, time.time)
                except GatewayError as exc:
                    # Keep the last picture and say why it is stale; the gateway may be
                    # restarting, and `top` should come back when it does.
                    error = str(exc)
                live.update(top_view(snap, url, console.width, error), refresh=True)
                refreshes += 1
    except KeyboardInterrupt:
        pass
    finally:
        client.close()


def dlq(
    url: Url = DEFAULT_URL,
    key: Key = None,
    json: Json = False,
    limit: Annotated[
        int, typer.Option(help="Most dead letters listed, newest first.", min=1, max=1000)
    ] = 100,
) -> None:
    """Dead letters: messages of this key's calls that could not be read (each call was
    answered with an error and not run)."""
    entries = _read(url, key, lambda client: client.get("/dlq", limit=limit))
    if json:
        _print_json(entries)
        return
    console = _console()
    console.print(dlq_table(entries, time.time(), wide=console.width >= WIDE_COLUMNS))


def register(app: typer.Typer) -> None:
    for command in (status, jobs, workers, timeline, top, dlq):
        app.command(command.__name__)(command)

"""Every Tinker SDK minor from 0.16 to 0.38 through the same end-to-end loop, against one
local cluster: the sweep behind docs/sdk.md's table (CI runs four of them).

    scripts/sdk_matrix.sh --all          # once: the latest patch of every minor, side by side
    scripts/infra.sh up                  # Kafka and Redis
    .venv/bin/python bench/sdk_minors.py [--versions 0.16.1,0.21.0]

Each version runs tests/sdk_loop.py (LoRA training client, forward_backward and optim_step
twice, save_weights_and_get_sampling_client, sample; and, unless --short, its `--more`
calls: capabilities, get_info, forward, save_state, load_state, a client from the state, a
named sampler save, compute_logprobs) in its own process with its side install first on
PYTHONPATH. A version passes when the loop ends, its second loss is below its first, it
ran the side install, not .venv's SDK, and the gateway reads its version off the headers
it sends (plexrl_gateway.sdk); every version should also get the newest one's losses,
samples and logprobs exactly (same seeds, same calls). Prints a table and ends with one
JSON line; exits 1 when any version fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.sdk_support

import httpx  # noqa: E402

from plexrl.models import init_tiny  # noqa: E402
from plexrl_gateway.sdk import sdk_version  # noqa: E402
from plexrl_tools.cluster import ClusterConfig, LocalCluster  # noqa: E402
from tests.sdk_support import (  # noqa: E402
    SDK_DIR,
    installed,
    installed_sdks,
    loop_result,
    run_sdk_loop,
)

KEY = "tml-sdk-minors"
MODEL = "plexrl/tiny-qwen3"


def latest_patch_per_minor(versions: list[str], first: int = 16, last: int = 38) -> list[str]:
    """The newest `0.M.P` of each minor M in [first, last], oldest minor first."""
    newest: dict[int, tuple[int, int, int]] = {}
    for text in versions:
        major, minor, patch = (int(part) for part in text.split("."))
        if major == 0 and first <= minor <= last:
            newest[minor] = max(newest.get(minor, (0, 0, 0)), (major, minor, patch))
    return [".".join(map(str, newest[m])) for m in sorted(newest)]


# The headers a version's client sends on every request (its Stainless defaults).
_PRINT_HEADERS = """
import json
from tinker._client import AsyncTinker
client = AsyncTinker(api_key="tml-x", base_url="http://127.0.0.1:9")
print(json.dumps({k: v for k, v in client.default_headers.items() if isinstance(v, str)}))
"""


def version_from_headers(sdk: Path) -> str:
    """The version the gateway reads off what the SDK in `sdk` sends (plexrl_gateway.sdk)."""
    env = {**os.environ, "PYTHONPATH": str(sdk)}
    done = subprocess.run(
        [sys.executable, "-c", _PRINT_HEADERS], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        return "error: " + (done.stderr.strip().splitlines() or ["?"])[-1]
    sent = {k.lower(): v for k, v in json.loads(done.stdout).items()}
    return str(sdk_version(sent))


_REQUESTS = re.compile(
    r'plexrl_gateway_requests_total\{endpoint="([^"]*)",method="([^"]*)",status="([^"]*)"\} (\S+)'
)


def refused(base_url: str) -> dict[str, int]:
    """The gateway's answers so far that were not 2xx, by `METHOD endpoint status` (from its
    /metrics): an SDK may swallow a 4xx (telemetry, heartbeats) and still pass the loop."""
    counts = {}
    for endpoint, method, status, value in _REQUESTS.findall(httpx.get(f"{base_url}/metrics").text):
        if not status.startswith("2"):
            counts[f"{method} {endpoint} {status}"] = int(float(value))
    return counts


# What every version must get alike (checkpoint paths name the run, so they differ).
SAME = ("losses", "sampled", "forward", "named_sample", "prompt_logprobs")


def run_one(version: str, config: ClusterConfig, tokenizer_dir: Path, more: bool) -> dict[str, Any]:
    sdk = installed(f"tinker-{version}")
    if sdk is None:
        return {"version": version, "ok": False, "error": "not installed (sdk_matrix.sh --all)"}
    read = version_from_headers(sdk)
    refused_before = refused(config.gateway_url)
    started = time.monotonic()
    done = run_sdk_loop(
        sdk, config.gateway_url, KEY, MODEL, tokenizer_dir, timeout_s=600, more=more
    )
    wall_s = round(time.monotonic() - started, 1)
    refused_now = {
        k: n - refused_before.get(k, 0)
        for k, n in refused(config.gateway_url).items()
        if n > refused_before.get(k, 0)
    }
    row: dict[str, Any] = {
        "version": version,
        "headers_say": read,
        "wall_s": wall_s,
        "gateway_non_2xx": refused_now,
    }
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["(no output)"]
        return {**row, "ok": False, "error": tail[0][-300:], "output": done.stderr[-4000:]}
    result = loop_result(done)
    first, second = result["losses"]
    ran_side_install = result["sdk"] == version and result["file"].startswith(str(sdk))
    ok = ran_side_install and second < first and read == version
    error = (
        "ran another SDK"
        if not ran_side_install
        else "loss did not fall"
        if second >= first
        else f"its headers say {read}"
        if read != version
        else ""
    )
    return {**row, "ok": ok, "error": error, **{k: result[k] for k in SAME if k in result}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", help="comma-separated; default: every installed minor")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the worker")
    parser.add_argument("--short", action="store_true", help="only the loop CI runs")
    args = parser.parse_args()
    versions = (
        args.versions.split(",") if args.versions else latest_patch_per_minor(installed_sdks())
    )
    if not versions:
        sys.exit(f"no SDK under {SDK_DIR}; run scripts/sdk_matrix.sh --all first")

    with tempfile.TemporaryDirectory(prefix="plexrl-sdk-minors-") as tmp:
        work = Path(tmp)
        init_tiny(work / "models" / "tiny-qwen3")
        config = ClusterConfig.on_free_ports(
            work / "models",
            work / "cluster",
            "minors",
            api_keys=f"{KEY}=sdk-minors",
            worker_threads=args.threads,
        )
        rows = []
        with LocalCluster(config):
            for version in versions:
                row = run_one(version, config, work / "models" / "tiny-qwen3", not args.short)
                print(f"{version}: {'ok' if row['ok'] else 'FAILED ' + row['error']}", flush=True)
                if not row["ok"] and row.get("output"):
                    print(row["output"], file=sys.stderr, flush=True)
                rows.append(row)

    reference = next((r for r in reversed(rows) if r["ok"]), None)
    header = f"{'SDK':<8} {'headers say':<12} {'result':<7} {'wall s':>7}  {'losses':<24}"
    print(f"\n{header} {'same as ' + versions[-1]:<16} gateway non-2xx")
    for row in rows:
        losses = ", ".join(f"{v:.4f}" for v in row.get("losses", []))
        same = (
            reference is not None
            and row["ok"]
            and all(row.get(k) == reference.get(k) for k in SAME)
        )
        row["same_as_newest"] = same
        result = "ok" if row["ok"] else "FAILED"
        wall = row.get("wall_s", float("nan"))
        same_text = "yes" if same else "no"
        read = row.get("headers_say", "")
        refused_text = ", ".join(f"{k} x{n}" for k, n in row.get("gateway_non_2xx", {}).items())
        print(
            f"{row['version']:<8} {read:<12} {result:<7} {wall:>7.1f}  {losses:<24} "
            f"{same_text:<16} {refused_text or 'none'}"
        )
    summary = {
        "bench": "sdk_minors",
        "versions": len(rows),
        "passed": sum(r["ok"] for r in rows),
        "failed": [r["version"] for r in rows if not r["ok"]],
        "all_same_as_newest": all(r["same_as_newest"] for r in rows),
        "gateway_non_2xx": sum(sum(r.get("gateway_non_2xx", {}).values()) for r in rows),
        "rows": [{k: v for k, v in r.items() if k != "output"} for r in rows],
    }
    print(json.dumps(summary), flush=True)
    sys.exit(0 if not summary["failed"] else 1)


if __name__ == "__main__":
    main()

"""Tiny workloads for the simulator tests, built in code so every number is in view."""

from __future__ import annotations

from pathlib import Path

import yaml


def write_workload(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / f"{doc['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def two_jobs_one_worker(
    device_bytes: int = 100, bandwidth: float = 1e12, state_bytes: int = 10, switch_s: float = 0.0
) -> dict:
    """Two identical deterministic jobs (2 steps: sample 2 s, reward 3 s, train 1 s) on one
    worker; the hand-computed scenario of test_sim_exact (engine switches cost `switch_s`)."""
    return {
        "name": "two-jobs",
        "cluster": {"colocation": {"switch_s": switch_s}},
        "workers": [
            {
                "id": "w0",
                "device_bytes": device_bytes,
                "host_bytes": 1000,
                "device_host_bytes_per_s": bandwidth,
                "host_disk_bytes_per_s": bandwidth,
            }
        ],
        "profiles": {
            "p": {
                "devices": 1,
                "state_bytes": state_bytes,
                "rollout": {"sample_s": 2.0},
                "reward_s": 3.0,
                "train_s": 1.0,
                "split": {"rollout_fraction": 0.5, "sync_s": 0.0},
            }
        },
        "jobs": [
            {"id": "A", "profile": "p", "steps": 2},
            {"id": "B", "profile": "p", "steps": 2},
        ],
    }


def small_trace(jobs: int = 24, days: float = 0.5) -> dict:
    """A few dozen stochastic jobs of two sizes on 64 GPUs, for invariants and determinism."""

    def profile(devices: int, state: str, sample: float, train: float) -> dict:
        return {
            "devices": devices,
            "state_bytes": state,
            "rollout": {
                "lengths": {
                    "batch_size": 64,
                    "median_tokens": 400,
                    "sigma": 1.0,
                    "max_tokens": 4096,
                    "decode_s_per_token": sample,
                    "prefill_s": 1.0,
                }
            },
            "reward_s": {"median": 60.0, "sigma": 0.6},
            "train_s": {"median": train, "sigma": 0.1},
            "fb_calls": 2,
            "train_util": 0.8,
            "optim_s": 2.0,
            "save_s": 3.0,
            "misc_s": {"median": 2.0, "sigma": 0.3},
            "create_s": 10.0,
        }

    return {
        "name": "small-trace",
        "cluster": {
            "gpus": 64,
            "device_bytes_per_gpu": "20 GB",
            "host_bytes_per_gpu": "100 GB",
        },
        "profiles": {
            "small": profile(8, "150 GB", 0.02, 20.0),
            "big": profile(16, "250 GB", 0.03, 40.0),
        },
        "trace": {
            "days": days,
            "jobs": jobs,
            "mix": {"small": 0.6, "big": 0.4},
            "steps": {"median": 20, "sigma": 0.5, "min": 3, "max": 60},
            "stall_scale": {"median": 2.0, "sigma": 0.6},
            "diurnal": 0.5,
        },
    }

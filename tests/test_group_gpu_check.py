"""bench/group_gpu_check.py, the script a machine with a GPU runs (one CUDA rank: train,
swap out and in through every tier, bit-identical, the swap bandwidth), checked here on
one CPU rank as far as the code allows: the same checks, gloo instead of NCCL."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import group_gpu_check


def test_the_gpu_check_passes_on_a_cpu_rank(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--device", "cpu", "--layers", "2", "--hidden", "128"]
    code = group_gpu_check.main([*argv, "--rows", "2", "--length", "16", "--swaps", "2"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and line["failures"] == []
    assert line["benchmark"] == "group_gpu_check" and line["device"] == "cpu"
    assert line["swap_bytes"] > 0 and line["d2h_GBps"] > 0 and line["h2d_GBps"] > 0
    for job in ("full", "lora"):
        assert line[f"{job}_loss_after_round_trip"] < line[f"{job}_loss_first"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_without_a_gpu_it_says_how_to_check_the_script(capsys: pytest.CaptureFixture[str]) -> None:
    assert group_gpu_check.main([]) == 2
    assert "--device cpu" in capsys.readouterr().err

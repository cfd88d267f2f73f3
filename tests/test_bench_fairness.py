"""bench/fairness.py's own arithmetic, without a cluster."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from fairness import heavy_batch, percentile, ratios, summary, within_one_call


def test_percentile_is_by_rank_and_refuses_no_samples() -> None:
    xs = [float(x) for x in range(1, 101)]  # 1 .. 100
    assert percentile(xs, 0.5) == 51.0
    assert percentile(xs, 0.99) == 100.0
    assert percentile([3.0, 1.0, 2.0], 0.99) == 3.0
    with pytest.raises(ValueError, match="--steps"):
        percentile([], 0.5)


def test_summary_drops_the_warm_up_step_and_ratios_compare_like_with_like() -> None:
    alone = summary([9.0, 0.04, 0.05, 0.06], [9.0, 0.02, 0.03, 0.04])
    assert alone == {"step_p50_s": 0.05, "step_p99_s": 0.06, "fb_p50_s": 0.03, "fb_p99_s": 0.04}
    beside = {"step_p50_s": 0.1, "step_p99_s": 0.6, "fb_p50_s": 0.03, "fb_p99_s": 0.4}
    assert ratios(alone, beside) == {
        "step_p50_x": 2.0,
        "step_p99_x": 10.0,
        "fb_p50_x": 1.0,
        "fb_p99_x": 10.0,
    }


def test_the_target_allows_one_heavy_call_more_than_alone() -> None:
    assert within_one_call(0.05, 1.05, 1.0)
    assert not within_one_call(0.05, 1.1, 1.0)


def test_a_heavy_call_is_whole_rows_of_the_asked_tokens() -> None:
    batch = heavy_batch(1024)
    assert len(batch) == 8
    assert all(len(d.model_input.to_ints()) == 127 for d in batch)
    assert len(heavy_batch(10)) == 1

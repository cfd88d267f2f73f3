"""bench/peer.py's own arithmetic and the model copy it hands the peer, without the peer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from peer import peer_model, steady


def test_steady_counts_only_steps_while_every_job_is_warm_and_running() -> None:
    # Two jobs, step ends in seconds; warm-up of 2 steps: the window is (3.0, 6.0].
    ends = [[1.0, 3.0, 4.0, 5.0, 6.0], [2.0, 2.5, 3.5, 4.5, 7.0]]
    figures = steady(ends, warmup=2)
    assert figures["steps_per_s"] == pytest.approx(5 / 3.0, abs=1e-3)  # 4, 5, 6, 3.5, 4.5
    assert figures["whole_run_steps_per_s"] == pytest.approx(8 / 6.0, abs=1e-3)
    assert figures["step_s"] == [[2.0, 1.0, 1.0, 1.0], [0.5, 1.0, 1.0, 2.5]]


def test_steady_refuses_jobs_that_never_overlapped_warm() -> None:
    with pytest.raises(SystemExit, match="raise --steps"):
        steady([[1.0, 2.0], [5.0, 6.0]], warmup=2)


def test_the_peers_copy_reads_as_transformers_4_writes_it(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"rope_parameters": {"rope_theta": 10000.0}}))
    (src / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "TokenizersBackend", "extra_special_tokens": ["<a>"]})
    )
    copy = peer_model(src, tmp_path / "copy")
    config = json.loads((copy / "config.json").read_text())
    assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None
    tok = json.loads((copy / "tokenizer_config.json").read_text())
    assert tok["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok["additional_special_tokens"] == ["<a>"] and "extra_special_tokens" not in tok
    assert json.loads((src / "config.json").read_text()) == {
        "rope_parameters": {"rope_theta": 10000.0}
    }  # the original is untouched

"""Runs lm-evaluation-harness on the task YAMLs of one folder and prints what it answered.

    PYTHONPATH=<lm-eval side install> python tests/lm_eval_run.py TASKS_DIR TASK MODEL_ARGS

Run by tests/test_openai.py as a subprocess, with lm-eval on PYTHONPATH (scripts/
eval_client.sh). lm-eval's command line indexes its thousands of built-in task files
first (about 15 s here); this reads only the given folder. Prints one JSON line: the
task's metrics and, per document, its target and each request's first argument (a
generation's prompt; a loglikelihood's context and continuation) and answer (a
generation's text; a loglikelihood's (logprob, is_greedy)).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager


def _sample(s: dict[str, Any]) -> dict[str, Any]:
    args = [a[:2] if isinstance(a[1], str) else a[0] for a in s["arguments"]]
    return {"target": s["target"], "arguments": args, "resps": [r[0] for r in s["resps"]]}


def main() -> None:
    tasks_dir, task, model_args = sys.argv[1:4]
    out = simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_defaults=False, include_path=tasks_dir),
        log_samples=True,
    )
    assert out is not None
    samples = [_sample(s) for s in out["samples"][task]]
    print(json.dumps({"metrics": out["results"][task], "samples": samples}, default=str))


if __name__ == "__main__":
    main()

"""Runs lm-evaluation-harness on the task YAMLs of one folder and prints what it answered.

    PYTHONPATH=<lm-eval side install> python tests/lm_eval_run.py TASKS_DIR TASK MODEL_ARGS

Run by tests/test_openai.py as a subprocess, with lm-eval on PYTHONPATH (scripts/
eval_client.sh). lm-eval's command line indexes its thousands of built-in task files
first (about 15 s here); this reads only the given folder. Prints one JSON line: the
task's metrics and each document's prompt and response.
"""

from __future__ import annotations

import json
import sys

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager


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
    samples = [
        {"prompt": s["arguments"][0][0], "response": s["resps"][0][0]} for s in out["samples"][task]
    ]
    print(json.dumps({"metrics": out["results"][task], "samples": samples}))


if __name__ == "__main__":
    main()

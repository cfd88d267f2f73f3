#!/usr/bin/env bash
# Install an evaluation client PlexRL did not write, EleutherAI's lm-evaluation-harness,
# beside .venv (never into it) for tests/test_openai.py:
#
#   scripts/eval_client.sh   then  .venv/bin/python -m pytest tests/test_openai.py
#
# It lands in .plexrl/eval/lm-eval-<version> with --no-deps: the test puts that folder
# first on PYTHONPATH and runs .venv's Python, so the folder holds exactly what lm-eval
# (with its `api` extra, which the local-completions model needs) imports and the lock
# lacks: the set `uv pip install --dry-run --python .venv/bin/python "lm-eval[api]==0.4.13"`
# names. python-dateutil is there at 2.9 because pandas reads it; .venv's 4.0 stays for
# PlexRL. Pinned and idempotent: a folder whose stamp names this list is kept.
# PLEXRL_EVAL_DIR moves it.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PLEXRL_LOG_TAG=eval-client
# shellcheck source=scripts/_lib.sh
source "$ROOT/scripts/_lib.sh"

EVAL_DIR=${PLEXRL_EVAL_DIR:-$ROOT/.plexrl/eval}
# Keep in step with tests/test_openai.py.
LM_EVAL_VERSION=0.4.13
LM_EVAL_EXTRA=(
  absl-py==2.5.1 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 attrs==26.1.0
  chardet==6.0.0.post1 cloudpickle==3.1.3 colorama==0.4.6 dataproperty==1.1.1
  datasets==5.2.0 defusedxml==0.7.1 dill==0.4.1 evaluate==0.4.6 frozenlist==1.8.0
  joblib==1.6.0 lxml==6.1.3 mbstrdecoder==1.1.5 more-itertools==11.2.1 multidict==7.2.1
  multiprocess==0.70.19 narwhals==2.29.0 nltk==3.10.4 pandas==3.1.1 pathvalidate==3.3.1
  portalocker==4.4.2 propcache==0.5.4 pyarrow==26.0.1 pytablewriter==1.2.1
  python-dateutil==2.9.0.post0 pytz==2026.6 rouge-score==0.1.2 sacrebleu==2.6.0
  scikit-learn==1.9.1 scipy==1.17.1 six==1.17.0 sqlitedict==2.1.0 tabledata==1.3.5
  tabulate==0.10.0 tcolorpy==0.1.7 tenacity==9.2.1 threadpoolctl==3.8.0 tiktoken==0.14.0
  typepy==1.3.5 word2number==1.1 xxhash==4.1.0 yarl==1.25.1
)

main() {
  local name="lm-eval-$LM_EVAL_VERSION" dir stamp
  dir=$EVAL_DIR/$name
  stamp=$(printf '%s\n' "lm-eval==$LM_EVAL_VERSION" "${LM_EVAL_EXTRA[@]}")
  if [[ -f $dir/.plexrl-stamp && $(<"$dir/.plexrl-stamp") == "$stamp" ]]; then
    log "$name is installed"
    return 0
  fi
  # uv comes with .venv (scripts/bootstrap.sh pins it).
  [[ -x $ROOT/.venv/bin/uv ]] || "$ROOT/scripts/bootstrap.sh"
  log "installing lm-eval==$LM_EVAL_VERSION into ${dir#"$ROOT"/}"
  rm -rf "$dir"
  mkdir -p "$EVAL_DIR"
  local -a uv=("$ROOT/.venv/bin/uv" pip install --python "$ROOT/.venv/bin/python" --no-deps)
  [[ ${CI:-} == true ]] && uv+=(--no-progress)
  "${uv[@]}" --target "$dir" "lm-eval==$LM_EVAL_VERSION" "${LM_EVAL_EXTRA[@]}" \
    || die "installing lm-eval failed; see the output above"
  compile_bytecode "$ROOT/.venv/bin/python" "$dir"
  echo "$stamp" >"$dir/.plexrl-stamp"
}

main "$@"

#!/usr/bin/env bash
# Mutation testing of core modules with mutmut 3 (issue 17); a script, not a CI job. Results: docs/testing.md.
#   pip install mutmut==3.8.1                    (into the project's venv; 3.3.1 fails on pytest 9: item._nodeid)
#   bash tools/mutation_run.sh [MUTANT_GLOB...]  e.g. 'intone.engine.scheduler*'; none: all four modules
# mutmut writes a mutated copy under ./mutants/, so this runs in a scratch copy ($MUT_DIR, default /tmp/mut, wiped):
# the repo is never touched. Afterwards: cd $MUT_DIR && mutmut results && mutmut show NAME
# (`mutmut run NAME` there re-runs one mutant, e.g. after copying a new test into $MUT_DIR/tests).
# MUTMUT_CHILDREN workers (default 2; ~26 min for the 737 mutants on 2 shared cores). MUT_KEEP=1 reuses an
# existing $MUT_DIR and its results. `mutmut results` (printed last) lists the survivors.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${MUT_DIR:-/tmp/mut}
[ "$(cd "$dir" 2>/dev/null && pwd)" != "$repo" ] || { echo "MUT_DIR must not be the repo" >&2; exit 2; }
if [ -z "${MUT_KEEP:-}" ]; then
  rm -rf "$dir" && mkdir -p "$dir"
  cp -r "$repo"/{src,tests,pyproject.toml,profiles,voices} "$dir"/
  find "$dir" -name __pycache__ -prune -exec rm -rf {} + && rm -rf "$dir"/src/*.egg-info
fi
cd "$dir"
export TARGETS="src/intone/engine/chunk_planner.py src/intone/engine/scheduler.py src/intone/ops/sampling.py
  src/intone/api/media.py"
# The fast tests that exercise them (mutmut runs, per mutant, only the tests that called the mutated function).
export TESTS="tests/engine/test_chunk_planner.py tests/engine/test_chunk_planner_boundaries.py tests/engine/test_core.py
  tests/engine/test_scheduler_states.py tests/engine/test_sampling.py tests/engine/test_sampling_filters.py
  tests/engine/test_sampling_hash.py tests/models/cosyvoice3/test_sampling.py tests/api/test_media_paths.py
  tests/api/test_media_sources.py tests/api/test_remote_media.py"
export DESELECT="tests/engine/test_core.py::test_no_leaks_after_200_requests_half_cancelled
  tests/engine/test_core.py::test_32_streams_exact_backlog_and_batch_independent"  # 35 s and minutes: too slow
grep -q '^\[tool.mutmut\]' pyproject.toml || python - <<'PY'
import json, os
env = {k: os.environ[k].split() for k in ("TARGETS", "TESTS", "DESELECT")}
extra = ["-p", "no:cacheprovider"] + [a for t in env["DESELECT"] for a in ("--deselect", t)]
with open("pyproject.toml", "a") as f:  # the whole package is copied to mutants/; only the targets are mutated
    f.write('\n[tool.mutmut]\nsource_paths = ["src/"]\nalso_copy = ["profiles/", "voices/"]\n'
            f'only_mutate = {json.dumps(env["TARGETS"])}\n'
            f'pytest_add_cli_args_test_selection = {json.dumps(env["TESTS"])}\n'
            f'pytest_add_cli_args = {json.dumps(extra)}\n'
            # a mutant that stops the engine admitting or freeing hangs test_core: cut it at 5x (not 15x)
            'timeout_multiplier = 5.0\ntimeout_constant = 2.0\n')
PY
export INTONE_CACHE=${INTONE_CACHE:-/tmp/mut-cache}
export OMP_NUM_THREADS=1  # libgomp is not fork-safe: with a thread pool, forked mutant runs deadlock (false timeouts)
mutmut run --max-children "${MUTMUT_CHILDREN:-2}" "$@" 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | tail -40
mutmut results

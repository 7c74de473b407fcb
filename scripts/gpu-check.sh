#!/usr/bin/env bash
# One-go GPU check: NIXL P/D with LMCache's CPU offload on D, then a hybrid model with
# vLLM's OffloadingConnector under KVComposeHMA, all under kvcompose, on one GPU.
#
# NOT YET RUN ON A GPU. It was written on CPU-only machines (where LMCache cannot store or
# load); its argument parsing, configs, commands, workload and metric reading are checked
# by tests/test_gpu_check.py, the GPU run itself has never happened. Expect to fix things.
#
# What it does (scripts/gpu_check.py has the details):
#   1. a baseline vLLM engine without connectors serves a prefix-heavy workload (greedy);
#   2. a prefill engine P (NixlConnector) and a decode engine D (kvcompose chain
#      [NixlConnector, LMCacheConnectorV1]) share the GPU; round 1 goes P -> D over NIXL,
#      round 2 goes to D alone and is served from LMCache's CPU tier;
#   3. checks: outputs equal the baseline's, P's KV cache is freed, per-tier hit tokens
#      (NIXL, LMCache) printed from D's /metrics;
#   4. the hybrid model (kvcompose's tiny-hybrid: 2 KV cache groups, one sliding): a
#      baseline, then one engine with a kvcompose tree (hma: true) holding vLLM's real
#      OffloadingConnector (GPU to CPU); round 1 offloads, round 2 loads from CPU; checks:
#      outputs equal the baseline's, the CPU tier hits in round 2, HMA stays on
#      (--skip-hybrid leaves it out). Exit status 0 when every check passes.
#
# Usage:
#   scripts/gpu-check.sh [--install] [--venv DIR] [GPU-CHECK ARGS...]
#     --install    create DIR (default .venv-gpu) with uv (pip if uv cannot be had) and
#                  install vLLM, LMCache, NIXL and kvcompose into it (the pins below)
#     --venv DIR   the environment to use (with --install: to create)
#   GPU-CHECK ARGS go to `python scripts/gpu_check.py` (see its --help), e.g.
#     --model Qwen/Qwen2.5-0.5B-Instruct --dtype auto, --requests 16, --dry-run,
#     --hybrid-model google/gemma-3-1b-it, --offload-cpu-gb 2, --skip-hybrid
#   Without --install the environment must already have vLLM, LMCache and NIXL (CUDA builds).
# Budget: under 8 minutes including installs (uv, a warm wheel cache helps), the tiny model.
# Environment: VLLM_VERSION (0.33.0), LMCACHE_VERSION (0.5.6), NIXL_PACKAGE (nixl-cu12==1.5.1).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv-gpu"
INSTALL=0
ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --install) INSTALL=1; shift ;;
    --venv)
      [[ $# -ge 2 ]] || { echo "gpu-check: --venv needs a directory" >&2; exit 2; }
      VENV="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"; shift 2 ;;
    --venv=*) VENV="${1#--venv=}"; shift ;;
    -h|--help) sed -n '2,32p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done

VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
LMCACHE_VERSION="${LMCACHE_VERSION:-0.5.6}"
NIXL_PACKAGE="${NIXL_PACKAGE:-nixl-cu12==1.5.1}"
PYTHON="$VENV/bin/python"
start=$SECONDS

if [[ "$INSTALL" == 1 ]]; then
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi >/dev/null 2>&1; then
    echo "gpu-check: no GPU here (nvidia-smi fails); nothing installed" >&2
    exit 2
  fi
  UV="$(command -v uv || true)"
  if [[ -z "$UV" ]] && python3 -m pip install --quiet --user uv >/dev/null 2>&1 \
     && python3 -m uv --version >/dev/null 2>&1; then
    UV="python3 -m uv"
  fi
  packages=("vllm==$VLLM_VERSION" "lmcache==$LMCACHE_VERSION" "$NIXL_PACKAGE")
  if [[ -n "$UV" ]]; then
    [[ -x "$PYTHON" ]] || $UV venv --quiet --python 3.11 "$VENV"
    $UV pip install --quiet --python "$PYTHON" "${packages[@]}" -e "$REPO"
  else
    [[ -x "$PYTHON" ]] || python3 -m venv "$VENV"
    "$PYTHON" -m pip install --quiet "${packages[@]}" -e "$REPO"
  fi
  echo "[gpu-check] installed into $VENV in $((SECONDS - start)) s"
fi

if [[ ! -x "$PYTHON" ]]; then
  echo "gpu-check: no Python at $PYTHON; pass --install or --venv DIR" >&2
  exit 2
fi
# The engines import kvcompose from this checkout, whatever is installed.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
status=0
"$PYTHON" "$REPO/scripts/gpu_check.py" --python "$PYTHON" ${ARGS[@]+"${ARGS[@]}"} || status=$?
echo "[gpu-check] total $((SECONDS - start)) s"
exit "$status"

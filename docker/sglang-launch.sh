#!/bin/sh
# Starts SGLang in its container with flags taken from the environment (set in docker-compose.yml),
# so a deployment changes model, parallelism and parsers without editing the compose file.
#   MODEL                 a directory under /models or a Hugging Face id, optionally org/name@revision
#                         (downloaded into the shared cache; the proxy reads the same snapshot)
#   SERVED_MODEL_NAME     name SGLang reports (default: MODEL without its @revision)
#   TP_SIZE               tensor-parallel size (default 1)
#   CONTEXT_LENGTH        context length (default: the model's)
#   REASONING_PARSER      e.g. qwen3, deepseek-r1 (needed for tool_choice grammars after reasoning)
#   TOOL_CALL_PARSER      e.g. qwen25 (the proxy parses tool calls itself; SGLang's parser is optional)
#   WEIGHT_VERSION        initial weight version (default initial)
#   SGLANG_EXTRA_ARGS     anything else, appended as is
set -eu
: "${MODEL:?set MODEL to a directory under /models or a Hugging Face model id}"
# org/name@revision: SGLang takes the revision as its own flag.
MODEL_PATH="${MODEL%%@*}"
set -- --model-path "$MODEL_PATH" --served-model-name "${SERVED_MODEL_NAME:-$MODEL_PATH}" \
    --host 0.0.0.0 --port "${SGLANG_PORT:-30000}" \
    --tp-size "${TP_SIZE:-1}" --weight-version "${WEIGHT_VERSION:-initial}"
if [ "$MODEL_PATH" != "$MODEL" ]; then set -- "$@" --revision "${MODEL#*@}"; fi
if [ -n "${CONTEXT_LENGTH:-}" ]; then set -- "$@" --context-length "$CONTEXT_LENGTH"; fi
if [ -n "${REASONING_PARSER:-}" ]; then set -- "$@" --reasoning-parser "$REASONING_PARSER"; fi
if [ -n "${TOOL_CALL_PARSER:-}" ]; then set -- "$@" --tool-call-parser "$TOOL_CALL_PARSER"; fi
# Word splitting is wanted here: extra arguments arrive as one string.
# shellcheck disable=SC2086
exec python3 -m sglang.launch_server "$@" ${SGLANG_EXTRA_ARGS:-}

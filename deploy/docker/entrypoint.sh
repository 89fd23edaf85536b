#!/usr/bin/env bash
# The GPU image's entrypoint: compile the served artifact on first start (cached on the volume), then serve.
#
#   entrypoint.sh [vision-serve flags...]   compile if needed, then exec vision-serve with the flags
#   entrypoint.sh COMMAND [args...]         exec COMMAND as it is (compile-trt, python, bash, ...)
#
# Environment (read here; vision-serve reads its own VISION_SERVE_* settings):
#   VISION_SERVE_ARTIFACT      the artifact folder vision-serve serves; when set, compile-trt compiles into it first
#                              (only this variable is read here: an artifact named by --artifact or in a
#                              --config file is served as it is, not compiled)
#   VISION_SERVE_COMPILE_ARGS  compile-trt's flags, split on whitespace (no quoting), e.g.
#                              "--model resnet152 --backend tensorrt --precision fp16 --batch 1,16,32"
#   VISION_SERVE_COMPILE       1 (default): run compile-trt before serving; 0: serve the artifact as it is
#                              (one built elsewhere and mounted, maybe read-only)
#
# Why compile here and not in `docker build`: no GPU is visible while an image builds, and a TensorRT
# engine is built for the GPU model and library versions it will run on.
set -euo pipefail

# VISION_SERVE_LOG_FORMAT=json (the images' default): this script's lines and compile-trt's are JSON
# objects too, as vision-serve's are, so that the container's log is one stream a shipper can parse.
LOG_FORMAT=${VISION_SERVE_LOG_FORMAT:-text}

json_string() { # $1 as a JSON string: backslashes, quotes and control characters escaped
	local text=${1//\\/\\\\}
	text=${text//\"/\\\"}
	text=${text//$'\n'/\\n}
	text=${text//$'\t'/\\t}
	printf '"%s"' "${text//[$'\001'-$'\037']/ }"
}

emit() { # emit LEVEL MESSAGE...: one line on stderr, in LOG_FORMAT
	local level=$1
	shift
	if [[ $LOG_FORMAT == json ]]; then
		printf '{"time": "%s", "level": "%s", "logger": "entrypoint", "pid": %d, "message": %s}\n' \
			"$(date -u +%Y-%m-%dT%H:%M:%S.%3NZ)" "$level" "$$" "$(json_string "$*")" >&2
	else
		printf 'entrypoint: %s\n' "$*" >&2
	fi
}
log() { emit info "$@"; }
log_error() { emit error "$@"; }

# compile-trt always runs (unless VISION_SERVE_COMPILE=0) and decides for itself: its cache key covers
# the model, weights, backend, precision, batch, GPU and library versions, so an artifact that is up to
# date is a cache hit (seconds: load and hash the weights, hash the engine) and anything else recompiles.
# It also takes a lock file next to the artifact, so a second container on the same volume waits for the
# first compile and then gets the cache hit.
compile_artifact() {
	local artifact=$1 parent status
	parent=$(dirname -- "$artifact")
	# The usual first-start failure: a bind-mounted host folder the image's user (a fixed UID) cannot
	# write. Said plainly here instead of as a Python traceback.
	if ! mkdir -p -- "$parent" 2>/dev/null || [[ ! -w $parent ]]; then
		log_error "cannot create or write ${parent} (as uid $(id -u)): give the image's user a writable volume" \
			"(a named volume, or chown the host folder to uid $(id -u)), or set VISION_SERVE_COMPILE=0 to serve" \
			"an artifact as it is."
		return 1
	fi
	# Split on any whitespace, newlines included (a YAML block value spans lines); no globbing.
	local -a args=()
	set -f
	# shellcheck disable=SC2206
	args=(${VISION_SERVE_COMPILE_ARGS:-})
	set +f
	if [[ " ${args[*]} " != *" --log-format"* ]]; then
		args+=(--log-format "$LOG_FORMAT")
	fi
	log "compile-trt ${args[*]} --output ${artifact} (a cache hit when the artifact is up to date)"
	# In the background with a trap, so that `docker stop` during a compile of several minutes stops
	# it at once: bash runs a trap only after its foreground child exits. The trap is set first, so
	# a signal that arrives just as the child starts is not lost.
	local child=""
	trap 'if [[ -n $child ]]; then kill -TERM "$child" 2>/dev/null || true; else exit 143; fi' TERM INT
	compile-trt "${args[@]}" --output "$artifact" &
	child=$!
	status=0
	wait "$child" || status=$?
	# wait returns early (>128) when the trap ran; wait again for compile-trt's own exit status.
	while kill -0 "$child" 2>/dev/null; do
		status=0
		wait "$child" || status=$?
	done
	trap - TERM INT
	case $status in
	0) return 0 ;;
	2) log_error "compile-trt rejected its arguments (see its message above); check VISION_SERVE_COMPILE_ARGS." ;;
	3) log_error "the accuracy gate failed: the compiled engine disagrees with eager fp32 beyond the thresholds, so no" \
		"artifact was written. Try another --precision or --backend in VISION_SERVE_COMPILE_ARGS." ;;
	4) log_error "the compile backend is not available here (see above). For --backend tensorrt the container needs a" \
		"GPU (docker run --gpus all, or compose's device reservation) and an image with torch_tensorrt." ;;
	130 | 143) log_error "the compile was interrupted by a signal; nothing was written, the next start compiles again." ;;
	*) log_error "compile-trt failed with exit code ${status} (see its log above)." ;;
	esac
	log_error "not starting vision-serve: no up-to-date artifact in ${artifact}."
	return "$status"
}

if [[ $# -eq 0 || $1 == -* ]]; then
	if [[ -n ${VISION_SERVE_ARTIFACT:-} && ${VISION_SERVE_COMPILE:-1} != 0 ]]; then
		status=0
		compile_artifact "$VISION_SERVE_ARTIFACT" || status=$?
		if [[ $status -ne 0 ]]; then
			exit "$status"
		fi
	fi
	# exec: vision-serve takes this process's place, so the SIGTERM of `docker stop` reaches it
	# directly and its graceful shutdown (finish the requests it holds, exit 0) runs.
	exec vision-serve "$@"
fi
exec "$@"

#!/usr/bin/env bash
# One GPU session on a lent machine that has no package registry (see ../shared/GPU.md), in phases
# that each fit one 10-minute command. The machine keeps /tmp while it stays up between commands.
#
#   bash benchmarks/gpu_session.sh core      # carried core wheels; pytest -m gpu (no DALI/CV-CUDA); compile
#   bash benchmarks/gpu_session.sh suite     # gpu_suite: ceilings, sweeps, Poisson, client ceiling
#   bash benchmarks/gpu_session.sh cvcuda    # CV-CUDA + nvImageCodec: tests, parity
#   bash benchmarks/gpu_session.sh dali      # DALI: tests, parity, preprocessing throughput
#   bash benchmarks/gpu_session.sh receive   # only take this run's share of the carried packs
#
# Order used on 2026-11-22 (H100; results/nvidia-h100-80gb-hbm3-2026-11-22): core with .carry/core and
# .carry/01, then a phase per run with .carry/02 .. .carry/05 (cvcuda from the third run, dali from
# the fifth). Keep the runs back to back: the machine and its /tmp go back 30 s after a run.
#
# Carried (made by benchmarks/gpu_pack.sh; named in each run's carry): .carry/core/*.whl, installed
# with --no-deps into /tmp/site next to the machine's own torch, and .carry/NN/chunk.* parts of one
# byte stream that holds cv.tar.xz then dali.tar.xz (sizes and sha256 in .carry/NN/stream.txt). Each
# run appends its chunks to /tmp/wh/stream and unpacks a pack once it is complete.
# Logs and results go to /tmp/gpu-results and are copied to $OUT as one tarball.
set -uo pipefail
phase=${1:?phase: core, suite, cvcuda, dali or receive}
out=${OUT:-/tmp/out}
results=/tmp/gpu-results
mkdir -p "$out" "$results" /tmp/wh /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
log() { echo "== $(date +%T) $*"; }

receive() {
  for dir in .carry/[0-9][0-9]; do
    [ -d "$dir" ] || continue
    for chunk in "$dir"/chunk.*; do
      name=$(basename "$chunk")
      if [ ! -e "/tmp/wh/$name" ]; then cat "$chunk" >>/tmp/wh/stream && touch "/tmp/wh/$name"; fi
    done
    cp "$dir/stream.txt" /tmp/wh/stream.txt
  done
  [ -f /tmp/wh/stream.txt ] || return 0
  local have offset=0
  have=$(stat -c %s /tmp/wh/stream)
  log "stream: $have bytes here ($(ls /tmp/wh | grep -c '^chunk') chunks)"
  while read -r pack size sum; do
    if [ ! -e "/tmp/wh/$pack.done" ] && [ "$have" -ge $((offset + size)) ]; then
      tail -c +$((offset + 1)) /tmp/wh/stream | head -c "$size" >"/tmp/wh/$pack"
      if echo "$sum  /tmp/wh/$pack" | sha256sum -c --quiet; then
        xz -d -T0 <"/tmp/wh/$pack" | tar -x -C /tmp/site && touch "/tmp/wh/$pack.done" && log "unpacked $pack"
      else
        log "checksum mismatch for $pack"
      fi
      rm -f "/tmp/wh/$pack"
    fi
    offset=$((offset + size))
  done </tmp/wh/stream.txt
}

install_core() {
  [ -e /tmp/site/.core ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/core/*.whl \
    && touch /tmp/site/.core && log "core wheels installed"
}

versions() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 - <<'PY'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| cudnn", torch.backends.cudnn.version(), "|", torch.cuda.get_device_name(0))
for name in ("torchvision", "litserve", "fastapi", "uvicorn", "nvidia-dali-cuda130", "cvcuda-cu13",
             "nvidia-nvimgcodec-cu13", "nvidia-nvjpeg", "torch-tensorrt", "tensorrt", "onnxruntime"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name}: not installed")
PY
}

pack_results() {
  cp /tmp/pytest-*.log /tmp/phase-*.log "$results"/ 2>/dev/null
  tar -C /tmp -czf "$out/gpu-results.tar.gz" gpu-results
}

gpu_tests() {  # $1: name, $2: -k expression, rest: test paths
  local name=$1 expr=$2
  shift 2
  python3 -m pytest -m gpu -k "$expr" -p no:cacheprovider --continue-on-collection-errors --timeout 400 -ra "$@" 2>&1 | tee "/tmp/pytest-$name.log" | tail -40
}

wait_for_compile() {  # $1: at most this many seconds
  local waited=0
  while pgrep -f "steps compile" >/dev/null && [ "$waited" -lt "$1" ]; do sleep 5; waited=$((waited + 5)); done
  log "compile: $(pgrep -f 'steps compile' >/dev/null && echo 'still running' || echo done)"
  tail -5 /tmp/phase-compile.log 2>/dev/null
}

receive
install_core
case "$phase" in
  receive) ls -la /tmp/wh ;;
  core)
    versions | tee "$results/versions-core.txt"
    # ResNet-152's compile for the suite runs beside the tests, in its own session so that it
    # outlives this command if it must (the suite phase waits for it).
    log "compile ResNet-152 fp16 (AOTInductor) for the suite, in the background"
    setsid timeout 900 python3 -m benchmarks.gpu_suite --steps compile --output-dir "$results" \
      >/tmp/phase-compile.log 2>&1 </dev/null &
    gpu_tests core "not dali and not cvcuda" tests/e2e/test_gpu.py tests/e2e/test_preprocess_serving.py \
      tests/unit/test_preprocessing_backends.py
    wait_for_compile 120
    ;;
  suite)
    wait_for_compile 240  # if it is still running, the suite's compile waits on its lock
    timeout 540 python3 -m benchmarks.gpu_suite --resume --steps ceiling,serve,client --output-dir "$results" 2>&1 \
      | grep -v "httpx" | tail -60
    ;;
  cvcuda)
    versions | tee "$results/versions-cvcuda.txt"
    python3 -c "import cvcuda, nvidia.nvimgcodec as n; print('cvcuda', cvcuda.__version__, 'nvimgcodec', n.__version__)"
    gpu_tests cvcuda "cvcuda" tests/unit/test_preprocessing_backends.py tests/e2e/test_preprocess_serving.py
    python3 -m benchmarks.preprocess_parity --device cuda --output "$results" 2>&1 | tail -20
    ;;
  dali)
    versions | tee "$results/versions-dali.txt"
    gpu_tests dali "dali" tests/unit/test_preprocessing_backends.py tests/e2e/test_preprocess_serving.py
    python3 -m benchmarks.preprocess_parity --device cuda --output "$results" 2>&1 | tail -20
    timeout 300 python3 -m benchmarks.preprocess_throughput --device cuda --repeats 3 \
      --output "$results/preprocess" 2>&1 | tail -40
    ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
pack_results

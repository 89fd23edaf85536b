#!/usr/bin/env bash
# The headline GPU run in one command of at most 8 minutes (docs/benchmarks.md, "On a GPU machine"):
# compiled ResNet-152 (AOTInductor fp16) served behind nvJPEG decode, against the eager + Pillow
# baseline, with the checks that qualify the numbers. Results go to $OUT after every step.
#
#   bash benchmarks/gpu_headline.sh             on the lent machine, carrying .carry/core (bash benchmarks/gpu/pack.sh)
#   bash benchmarks/gpu_headline.sh --rerun     on the same machine while it is still warm: the steps that
#                                               did not end ok, in 3 minutes (compile: a cache hit)
#   bash benchmarks/gpu_headline.sh --dry-run   here: the same steps on the CPU (Lite0, seconds of load), in
#                                               the stand-in venv (benchmarks/gpu/standin.sh), the carry
#                                               installed beside it as on the machine
#
# Other flags go to benchmarks/gpu/session.py (--budget-s, --out, --results).
set -euo pipefail
cd "$(dirname "$0")/.."
python=python3
case " $* " in
  *" --dry-run "*)
    if [ "$(cat .carry/core/.carry 2>/dev/null)" != "$(sha256sum benchmarks/gpu/carry.txt | cut -d' ' -f1)" ]; then
      bash benchmarks/gpu/pack.sh >&2
    fi
    python=$(bash benchmarks/gpu/standin.sh)
    export OUT=${OUT:-/tmp/gpu-headline-out}
    ;;
  *)
    # AOTInductor CUDA packages crash at load inside the bundled libstdc++ unless the system one (that of
    # the g++ that built them) is preloaded: compile/libstdcxx.py does it for compile-trt and vision-serve;
    # set here too, for every process of the run (found on an H100, 2026-11-22).
    libstdcxx=$(g++ -print-file-name=libstdc++.so.6 2>/dev/null || true)
    if [ -e /dev/nvidiactl ] && [ "${libstdcxx#/}" != "$libstdcxx" ] && [ -e "$libstdcxx" ]; then
      export LD_PRELOAD="$libstdcxx${LD_PRELOAD:+ $LD_PRELOAD}"
    fi
    ;;
esac
exec "$python" -m benchmarks.gpu.session headline "$@"

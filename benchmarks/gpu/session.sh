#!/usr/bin/env bash
# A GPU session's later phases, one per command (the headline is benchmarks/gpu_headline.sh):
#   bash benchmarks/gpu/session.sh extra|cvcuda|dali [--dry-run]
exec python3 -m benchmarks.gpu.session "$@"

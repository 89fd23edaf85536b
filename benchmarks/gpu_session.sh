#!/usr/bin/env bash
# A GPU session's phases, one per 10-minute command: benchmarks/gpu_session.py says which and how.
#   bash benchmarks/gpu_session.sh core|serve|extra|cvcuda|dali [--dry-run]
exec python3 -m benchmarks.gpu_session "$@"

"""``python -m benchmarks.gpu_suite``, the name docs/deployment.md and Dockerfile.gpu use: the GPU
benchmark is benchmarks/gpu/suite.py."""

import sys

from benchmarks.gpu.suite import main

if __name__ == "__main__":
    sys.exit(main())

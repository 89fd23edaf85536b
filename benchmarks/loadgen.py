"""``python -m benchmarks.loadgen``, the name the docs and results use: the load generator is
service/tune/loadgen.py (vision-tune loads its servers with it)."""

from service.tune.loadgen import main

if __name__ == "__main__":
    raise SystemExit(main())

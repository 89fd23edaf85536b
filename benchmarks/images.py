"""``python -m benchmarks.images DIR``, the name the docs and results use: the benchmark photos are
written by service/tune/images.py (vision-tune's default images)."""

from service.tune.images import main

if __name__ == "__main__":
    main()

"""vision-tune: find the fastest vision-serve configuration that meets a p99 latency target.

The vision-tune process (its own main process, never the server's): it drives others: compile-trt for
each engine and precision (each gated), then one real vision-serve per configuration measured, loaded
by the project's load generator (loadgen.py, with the benchmark photos of images.py). It uses the
client's launcher and the server's settings; nothing of the server imports it.
"""

"""vision-tune: find the fastest vision-serve configuration that meets a p99 latency target.

Runs in its own process and drives others: compile-trt for each engine and precision (each gated),
then one real vision-serve per configuration measured, loaded by the project's load generator.
"""

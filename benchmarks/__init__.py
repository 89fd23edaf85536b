"""The benchmarks, run from a checkout (``python -m benchmarks.<name>`` in the repository root; not in
the wheel). Each module at the top is one command: an experiment, a soak, a check (docs/benchmarks.md).

- ``harness/``: what the experiments share (inputs, servers, results folders, plots, the swap driver);
- ``peers/``: the servers measured beside vision-serve: TorchServe, Triton, LitServe, bare ASGI;
- ``gpu/``: the session on a lent GPU machine (``gpu_headline.sh`` starts it), its lists and scripts;
- ``results/``: what ran where, committed.

The load generator and the benchmark photos are vision-tune's (``service/tune/``); the bad-input
corpus is the tests' (``tests/bad_inputs.py``).
"""

"""A session on a lent GPU machine (docs/benchmarks.md, "On a GPU machine"): ``bash benchmarks/gpu_headline.sh``
runs its headline phase; session.py its phases, suite.py the GPU benchmark's steps, machine.py and
the three lists what the machine has, carries and what the stand-in venv holds, carry.py what travels
per run; pack.sh and standin.sh make the carried wheels and the stand-in."""

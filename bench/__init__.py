"""enginectl benchmarks (bench/README.md): `python -m bench` from the repository root.

One folder per family, each a `phase` the run calls (in the `python -m bench` process, which
only orchestrates) and the subprocesses it starts: weights/, staging/, fleet/, fpm/, rollouts/,
and soak/ (`python -m bench.soak`, a run of its own). run.py is the run itself, with the
GetWeightVersion figures; lib/ holds what more than one family uses.
"""

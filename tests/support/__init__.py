"""What the unit and the end-to-end tests share: `enginectl serve` as a subprocess
(serving.py), checkpoints and weight-service stubs (weights.py, weight_updates.py), the
in-memory engine (engine_double.py), FPM publishers and readers (fpm_helpers.py), fault and
fuzz drivers (fault_helpers.py, fuzz/), and the child processes some tests start
(fault_procs.py, trainer_proc.py). No fixtures: the conftest.py files provide those.

Imported as `support.*`: pytest puts tests/ on sys.path (its rootdir conftest.py lives there).
"""

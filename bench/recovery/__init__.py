"""The recovery soak: `python -m bench.recovery` (`make recovery-soak`); see run.py."""

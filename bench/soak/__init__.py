"""`python -m bench.soak` (`make soak`): a bounded soak of one real `enginectl serve` (bench/README.md)."""

"""Phase `multinode`: an engine whose rank 1 runs on node B beside the same engine on one host
(bench/multinode/phase.py)."""

"""Two-phase (staged) weight updates, on the weights bench's server (bench/README.md, figure 6)."""

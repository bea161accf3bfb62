"""Weight updates and pause/resume against their baselines and floors (bench/README.md, figure 6)."""

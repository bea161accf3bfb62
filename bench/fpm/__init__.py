"""Forward-pass metrics: latency, fan-in, overload and publish cost (bench/README.md, figures 4-5)."""

"""A fleet update, one broadcast to 2 servers vs the same update to 1 (bench/README.md, figure 8)."""

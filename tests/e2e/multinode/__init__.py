"""Tests of an engine whose ranks span nodes (DESIGN §13), on node B of bench/lib/two_node.py."""

"""Tests of an engine whose ranks span nodes (DESIGN §13), on node B of tests/support/two_node.py."""

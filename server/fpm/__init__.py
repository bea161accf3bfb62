"""Forward-pass metrics in the `enginectl serve` process: the relay, its stream and the worker identity."""

"""Forward-pass metrics inside each EngineCore: enginectl's scheduler, its publisher and the worker identity."""

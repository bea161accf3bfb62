"""The fuzzer of tests/e2e/test_fuzz.py: values (strategies.py), requests built from the
protobuf descriptors (requests.py), the calls and their outcomes (calls.py), what every outcome
must satisfy (checker.py), and the files UpdateWeightsFromDisk finds (fodder.py)."""

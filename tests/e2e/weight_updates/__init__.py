"""Weight-update tests on the session's `weights_server`, each ending back on checkpoint A
(the autouse `back_to_a` of this folder's conftest.py)."""

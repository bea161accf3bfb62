"""The names both sides of enginectl's `gloo` weight-transfer engine agree on: one definition.

Pure Python (no torch, no vLLM). The trainer's side (client/transfer_engine.py, in the trainer
process) and the workers' side (worker/weights/transfer/engine.py, inside vLLM's workers) are
registered in vLLM's two factories under one name, meet in a group of one default name, and
give a join the same margin past its rendezvous timeout (docs/weights.md, "vLLM's
weight-transfer engines").
"""

from __future__ import annotations

from typing import Final

# The engine's name in vLLM's factories and in `--weight-transfer-config '{"backend": ...}'`;
# its group is a torch.distributed group of the backend of the same name.
GLOO_TRANSFER_BACKEND: Final = "gloo"
# The group the trainer and the workers meet in when the trainer's init info names none.
DEFAULT_TRANSFER_GROUP: Final = "vllm-weight-transfer"
# How long a rendezvous and every broadcast of the group may take, unless the init info says.
DEFAULT_TRANSFER_TIMEOUT_S: Final = 60.0
# Past the rendezvous timeout, a thread still joining the group is given up on.
TRANSFER_JOIN_MARGIN_S: Final = 2.0

"""The weights room's gRPC servicers: each translates proto <-> the cores of server/weights/.

Runs in the `enginectl serve` process, on the control loop.
"""

from enginectl.server.weights.services.operations import OperationsServicer
from enginectl.server.weights.services.updates import WeightUpdateServicer
from enginectl.server.weights.services.version import WeightVersionServicer

__all__ = ["OperationsServicer", "WeightUpdateServicer", "WeightVersionServicer"]

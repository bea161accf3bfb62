"""The FPM room's gRPC servicers: each translates proto <-> the cores of server/fpm/.

Runs in the `enginectl serve` process, on the control loop.
"""

from enginectl.server.fpm.services.identity import FpmIdentityServicer
from enginectl.server.fpm.services.stream import ForwardPassMetricsServicer

__all__ = ["ForwardPassMetricsServicer", "FpmIdentityServicer"]

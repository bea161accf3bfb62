"""enginectl client: typed access to an enginectl server. Needs neither torch nor vLLM.

    from enginectl.client import Client
    with Client("127.0.0.1:50051") as c:
        c.set_weight_version("step-42")
        print(c.get_weight_version())
"""

from enginectl.client.client import AsyncClient, ChannelConfig, Client
from enginectl.client.errors import (
    AbortedError,
    DeadlineExceededError,
    EnginectlError,
    FailedPreconditionError,
    FieldViolation,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    Reason,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from enginectl.client.types import UpdateFailure, WeightSource, WeightVersion

__all__ = [
    "AbortedError",
    "AsyncClient",
    "ChannelConfig",
    "Client",
    "DeadlineExceededError",
    "EnginectlError",
    "FailedPreconditionError",
    "FieldViolation",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfRangeError",
    "Reason",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "UpdateFailure",
    "WeightSource",
    "WeightVersion",
]

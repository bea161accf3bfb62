"""The trailing metadata that ends every Generate of vLLM's gRPC engine service on the control
port: which weight versions generated the tokens (docs/rollouts.md).

Pure Python: the server writes these trailers (server/rollouts.py), the client reads them
(client/rollouts.py).

- `enginectl-weight-declared`: `true` (every token came from declared weights), `false` (none
  did: the versions trailer is absent) or `partial`;
- `enginectl-weight-versions`: the declared versions in the order they generated the tokens,
  comma-separated, each percent-encoded (RFC 3986) outside printable ASCII and for space, ","
  and "%"; two or more when the request straddled an update or a declaration;
- `enginectl-weight-revision`: the ledger revision of the latest declaration of the version
  the request finished under; absent when it finished on undeclared weights.
"""

from __future__ import annotations

import urllib.parse
from typing import Final

DECLARED_TRAILER: Final = "enginectl-weight-declared"
VERSIONS_TRAILER: Final = "enginectl-weight-versions"
REVISION_TRAILER: Final = "enginectl-weight-revision"

# Printable ASCII but space, "," (the separator) and "%" (the escape) stays as it is.
_SAFE: Final = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in ",%")


def encode_versions(versions: list[str]) -> str:
    """The `enginectl-weight-versions` value naming `versions`."""
    return ",".join(urllib.parse.quote(version, safe=_SAFE) for version in versions)


def decode_versions(value: str) -> list[str]:
    """The versions an `enginectl-weight-versions` value names."""
    return [urllib.parse.unquote(part) for part in value.split(",")] if value else []

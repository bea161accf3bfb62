"""data_parallel_size=2: a declaration reaches every EngineCore, not just the first.

vLLM's own `set_weight_version_async` goes through `call_utility_async`, which reaches
only the first engine; outputs from rank 1 would keep the old label.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest
from serving import ServeProcess, alive

from enginectl.client import Client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dp_server(serve_env: dict[str, str]) -> Iterator[ServeProcess]:
    srv = ServeProcess(["--data-parallel-size", "2", "--enable-scale-out"], serve_env).start().wait_ready()
    yield srv
    srv.kill()


def _generate_on_rank(server: ServeProcess, rank: int) -> dict:
    body = json.dumps({"token_ids": [1, 43, 375, 82], "sampling_params": {"max_tokens": 4, "temperature": 0.0}})
    request = urllib.request.Request(
        f"{server.http_url}/inference/v1/generate", data=body.encode(),
        headers={"content-type": "application/json", "X-data-parallel-rank": str(rank)},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]


def test_declared_version_stamps_outputs_of_both_ranks(dp_server: ServeProcess) -> None:
    assert dp_server.serving["dp_size"] == 2
    with Client(dp_server.grpc_target) as c:
        for version in ("dp-a", "dp-b"):
            c.set_weight_version(version)
            for rank in (0, 1):
                choice = _generate_on_rank(dp_server, rank)
                n = len(choice["token_ids"])
                assert choice["weight_versions"] == [{"version": version, "start": 0, "end": n}], rank


def test_sigterm_stops_both_engine_cores(dp_server: ServeProcess) -> None:
    children = dp_server.descendants()
    assert sum("EngineCore" in " ".join(p.cmdline() + [p.name()]) for p in children) >= 2
    assert dp_server.terminate() == 0, dp_server.tail()
    assert not alive(children), [p.pid for p in alive(children)]

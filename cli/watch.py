"""`enginectl fpm watch`: forward-pass metrics samples as they are relayed, resumable.

Runs in the `enginectl` process: one StreamForwardPassMetrics call read one message at a time
(client/fpm.py `iter_forward_pass_metrics`, on a private event-loop thread). Samples go to stdout
(JSON lines, or a row each on a terminal); what a resume needs goes to stderr: the
incarnation, and how many samples a slow reader missed with the sequence to resume after to
fetch them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from enginectl.cli.output import Output
from enginectl.cli.views import SAMPLE_COLUMNS, sample_row
from enginectl.client.client import ChannelConfig
from enginectl.client.fpm import FpmProgress, iter_forward_pass_metrics, stream_request


def watch(
    config: ChannelConfig,
    out: Output,
    *,
    worker_ids: Sequence[str] = (),
    dp_ranks: Sequence[int] = (),
    heartbeats: bool = False,
    since: int | None = None,
    incarnation: str = "",
    count: int = 0,
) -> None:
    """Print samples until the stream ends, `count` samples were printed (0: no bound), or
    Ctrl-C. With `since`, replay every kept sample after that sequence first (`incarnation`:
    refuse to resume into another incarnation). Raises EnginectlError when the stream fails."""
    request = stream_request(
        worker_ids=worker_ids,
        dp_ranks=dp_ranks,
        include_heartbeats=heartbeats,
        resume_after_sequence=since,
        resume_incarnation=incarnation,
    )
    events = iter_forward_pass_metrics(config, request)
    printed, last, live = 0, since, incarnation
    try:
        for event in events:
            if isinstance(event, FpmProgress):
                if not live and not out.json:
                    print(f"# incarnation {event.incarnation}, head sequence {event.head_sequence}", file=sys.stderr)
                live = event.incarnation
                continue
            if event.missed:
                resume = "" if last is None else f"; resume with --since {last} --incarnation {live} to fetch them"
                print(f"enginectl: missed {event.missed} samples (read too slowly){resume}", file=sys.stderr)
            for sample in event.samples:
                out.event(sample, SAMPLE_COLUMNS, sample_row)
                printed, last = printed + 1, sample.sequence
                if count and printed >= count:
                    return
    finally:
        events.close()

"""A fleet trainer killed after a failed commit, as a separate process.

Runs as `python tests/support/fleet_trainer_proc.py A,B FILE VERSION`: one `Fleet` over the
targets stages FILE on every server and commits it (`update_from_disk`, strict). When the commit
fails somewhere it prints every server's outcome ({"outcomes": {target: state or "ok"}}) and
exits at once with os._exit(1): a trainer killed before it could repair, whose successor knows
nothing of the stage or the commit. A commit that succeeds prints {"outcomes": {}} and exits 0.
"""

from __future__ import annotations

import json
import os
import sys

from enginectl.client import Fleet, FleetCommitError


def main() -> None:
    targets, file, version = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
    fleet = Fleet(targets, timeout=120.0)
    try:
        fleet.update_from_disk(file, version)
    except FleetCommitError as err:
        outcomes = {t: "ok" if o.ok else o.state for t, o in err.outcomes.items()}
        print(json.dumps({"outcomes": outcomes}), flush=True)
        os._exit(1)
    print(json.dumps({"outcomes": {}}), flush=True)
    fleet.close()


if __name__ == "__main__":
    main()

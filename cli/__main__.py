"""`python -m enginectl.cli`: the `enginectl` command."""

import sys

from enginectl.cli import main

sys.exit(main())

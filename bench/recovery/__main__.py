import sys

from bench.recovery.run import main

sys.exit(main())

import sys

from bench.soak.run import main

sys.exit(main())

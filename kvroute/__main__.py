"""``python -m kvroute``: the same as the ``kvroute`` command."""

import sys

from kvroute.cli import main

sys.exit(main())

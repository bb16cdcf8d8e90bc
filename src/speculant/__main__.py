"""``python -m speculant``: the same command line as the ``speculant`` script."""

import sys

from .cli import main

sys.exit(main())

"""``python -m graftlab``: the same command as the ``graftlab`` console script."""

import sys

from graftlab.cli import main

sys.exit(main())

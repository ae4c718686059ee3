"""``python -m graftlab``: the same command as the ``graftlab`` console script."""

import sys

from graftlab.commands.cli import main

sys.exit(main())

"""``python -m slake.cli``: the ``slake`` command."""

import sys

from slake.cli import main

sys.exit(main())

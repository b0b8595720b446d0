"""``python -m lightning_roundpipe.planning``: print a plan and its ring schedule (see :mod:`.cli`)."""

import sys

from lightning_roundpipe.planning.cli import main

sys.exit(main())

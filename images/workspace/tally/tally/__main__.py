"""Entry point for `python3 -m tally`."""

import sys

from tally.cli import main

sys.exit(main())

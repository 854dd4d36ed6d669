"""`python -m kvstore ...`: the kvstore command line (see kvstore/cli.py)."""

import sys

from kvstore.cli import main

sys.exit(main())

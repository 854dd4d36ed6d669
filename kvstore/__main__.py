"""`python -m kvstore ...`: the kvstore command line (kvstore.cli)."""

import sys

from kvstore.cli import main

sys.exit(main())

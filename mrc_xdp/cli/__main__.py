"""`python -m mrc_xdp.cli ...` is `mrc-xdp ...` (the tests run the CLI this way)."""
import sys

from mrc_xdp.cli import main

sys.exit(main())

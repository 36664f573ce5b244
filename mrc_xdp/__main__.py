"""`python -m mrc_xdp ...` is `mrc-xdp ...`."""
import sys

from mrc_xdp.cli import main

sys.exit(main())

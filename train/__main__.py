"""``python -m train --preset demo --out DIR``: see ``train.cli``."""

import sys

from train.cli import main

sys.exit(main(sys.argv[1:]))

"""``python -m engine serve ...`` is ``mtpserve serve ...``."""

import sys

from engine.cli import main

sys.exit(main())

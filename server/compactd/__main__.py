"""``python -m compactd``."""

import sys

from compactd.cli import main

sys.exit(main())

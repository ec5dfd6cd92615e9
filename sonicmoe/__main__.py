"""``python -m sonicmoe train|bench``."""

import sys

from .cli import main

sys.exit(main())

"""`python -m omnivideo.selftest` (inside ComfyUI's Python): see run.py."""

import sys

from .run import main

sys.exit(main())

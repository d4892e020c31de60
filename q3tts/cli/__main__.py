"""`python -m q3tts.cli`: the front of `q3tts serve --devices` starts its engine processes so."""

from __future__ import annotations

import sys

from .commands import main

sys.exit(main())

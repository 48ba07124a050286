"""``python -m firstbyte`` runs the ``firstbyte`` command."""

from __future__ import annotations

import sys

from firstbyte.cli import main

sys.exit(main())

"""``python -m client_sdk`` runs the ``firstbyte`` command."""

from __future__ import annotations

import sys

from firstbyte.client_sdk.cli import main

sys.exit(main())

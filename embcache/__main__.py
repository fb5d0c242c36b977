"""``python -m embcache`` runs the ``embcache`` command."""

import sys

from .cli import main

sys.exit(main())

"""``python -m embcache.server`` runs ``embcache-server``."""

import sys

from .main import main

sys.exit(main())

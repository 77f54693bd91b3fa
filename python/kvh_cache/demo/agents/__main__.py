"""``python -m kvh_cache.demo.agents``: the model demo (also the restart's new
process, ``--returning SPEC``)."""

import sys

from .app import main

sys.exit(main())

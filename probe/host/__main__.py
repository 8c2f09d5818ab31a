"""``python -m probe.host``: the node helper process (see ``probe.host.node``)."""

import sys

from probe.host.node import main

sys.exit(main())

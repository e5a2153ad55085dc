"""``python -m tidal.ckpt.agent``: run one node checkpoint agent (see ``server``)."""

import sys

from tidal.ckpt.agent.server import main

main()
sys.exit(0)

"""`python -m patchswarm.node.cli`: the `patchswarm` command."""

import sys

from patchswarm.node.cli import main

sys.exit(main())

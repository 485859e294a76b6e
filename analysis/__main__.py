"""``python -m analysis report|plan`` (see analysis.cli)."""

import sys

from analysis.cli import main

sys.exit(main())

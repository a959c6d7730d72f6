"""`python -m monitord` is the same as the `monitord` console script."""

import sys

from monitord.surface.cli import main

sys.exit(main())

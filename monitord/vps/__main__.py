"""`python -m monitord.vps VERB ...`: the VPS verbs (monitord.vps.entry)."""

import sys

from monitord.vps.entry import main

sys.exit(main())

"""monitord: the single owner of the PBX-to-VPS tunnel and of every area's placement.

The runtime (I/O) half of the project; decisions live in the pure `orchestrator` package.
"""

import warnings

__version__ = "0.2.0"

# cryptography 51 deprecates DSA and warns when asyncssh merely imports its DSA types, once per
# process on every CLI verb's stderr. monitord never offers, accepts or creates DSA keys.
warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh(\.|$)")

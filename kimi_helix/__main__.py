"""`python -m kimi_helix`: the `kimi-helix` command."""

import sys

from kimi_helix.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""python -m toolkit.tiny KIND OUT_DIR: write one tiny model into a folder of your choice."""

import sys
from pathlib import Path

from toolkit.tiny import TINY_WRITERS, write_tiny

if len(sys.argv) != 3:
    print(f"usage: python -m toolkit.tiny KIND OUT_DIR   (KIND: {', '.join(TINY_WRITERS)})", file=sys.stderr)
    sys.exit(2)
print(write_tiny(sys.argv[1], Path(sys.argv[2])))

"""`python -m tandem_services.launcher [flags]` (what `tandem serve` runs): flags are read
here, once."""

from __future__ import annotations

import sys

from tandem_services.launcher.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m tandem_services.frontend [flags]`: flags and environment are read here, once."""

from __future__ import annotations

import asyncio
import sys

from tandem_services.common.server import setup_logging
from tandem_services.frontend.app import serve
from tandem_services.frontend.config import config_from_args


def main(argv: list[str]) -> int:
    config = config_from_args(argv)
    setup_logging(config.log_level)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

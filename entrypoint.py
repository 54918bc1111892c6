"""The command line from a checkout: `python entrypoint.py ARGS` is `sglang-adapters ARGS`.

The pack installs as `sglang_dsv41_adapters` (the console script runs its `cli.main`); this
file stays at the repository's root so that the README's commands work from a checkout.
"""

import sys

from sglang_dsv41_adapters.cli import main

if __name__ == "__main__":
    sys.exit(main())

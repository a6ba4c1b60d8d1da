#!/usr/bin/env python3
"""A thin launcher of the ``melfeed`` command for a checkout: ``python run_pipeline.py ARGS`` is ``melfeed ARGS``.

melfeed must be installed (``pip install -e .`` in the checkout, or ``pip install .``): the code lives in the
package ``melfeed``, which the build maps from this repository's folders.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    try:
        from melfeed.cli import console_main
    except ModuleNotFoundError as err:
        if err.name != "melfeed":
            raise
        print("run_pipeline.py: melfeed is not installed; in this checkout run: pip install -e .", file=sys.stderr)
        sys.exit(78)
    console_main()

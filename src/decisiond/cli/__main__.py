"""``python -m decisiond.cli``: the command line, as the ``decisiond`` script runs it."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())

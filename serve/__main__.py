"""`python -m serve`: the same server and flags as `ds4-torch serve`."""
import sys

from .cli import main

sys.exit(main())

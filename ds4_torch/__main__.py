"""`python -m ds4_torch` is the same as the `ds4-torch` command."""
import sys

from .cli import main

sys.exit(main())

"""`python -m turnrouter` is the `turnrouter` command."""

import sys

from .cli import main

sys.exit(main())

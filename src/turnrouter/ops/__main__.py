"""`python -m turnrouter.ops`: regenerate (or `--check`) the generated operations files."""

from . import main

raise SystemExit(main())

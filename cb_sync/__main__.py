"""`python -m cb_sync`: the cb-sync command line."""
from .cli import main

raise SystemExit(main())

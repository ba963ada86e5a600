"""`python -m disco_ray ...`: the same as the `disco-ray` console script."""

from .cli import main

raise SystemExit(main())

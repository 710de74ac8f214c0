"""``python -m rl_demo``: see :mod:`rl_demo.cli`."""

from .cli import main

raise SystemExit(main())

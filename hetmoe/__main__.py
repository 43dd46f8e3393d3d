"""``python -m hetmoe ...`` is the ``hetmoe`` command."""

from hetmoe.cli import main

raise SystemExit(main())

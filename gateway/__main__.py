"""``python -m gateway``: the same as the ``alp-gateway`` command."""

from gateway.cli import main

raise SystemExit(main())

"""Run the simulator from the command line: ``python -m gateway.sim``."""

from gateway.sim.cli import main

raise SystemExit(main())

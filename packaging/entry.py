"""PyInstaller's entry point for the frozen ``alp-gateway`` executable: the same as the installed command."""

import sys

from gateway.cli import main

if __name__ == "__main__":
    sys.exit(main())

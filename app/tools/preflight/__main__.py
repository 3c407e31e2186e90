"""`python -m app.tools.preflight`: see app/tools/preflight/cli.py."""

import sys

from app.tools.preflight.cli import main

sys.exit(main())

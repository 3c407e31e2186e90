"""`python -m app.tools.doctor`: see app/tools/doctor/cli.py."""

import sys

from app.tools.doctor.cli import main

sys.exit(main())

"""`python -m app.tools.kv_budget`: see app/tools/kv_budget/cli.py."""

import sys

from app.tools.kv_budget.cli import main

sys.exit(main())

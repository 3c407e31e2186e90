"""Preflight: the tuning guide's deployment checklist, checked where the GPUs are (`python -m app.tools.preflight`;
usage in app/tools/preflight/cli.py).

Layout: readings (statuses, the checklist's values, Check, the Readings record), checks (pure functions of the
readings), gather (gather_readings, the only code that touches the machine), cluster (--cluster: the GPU checks as a
Ray task on every GPU node), cli.

The entry points other code uses are importable from here.
"""

from app.tools.preflight.checks import exit_code, run_checks
from app.tools.preflight.cli import main
from app.tools.preflight.gather import gather_readings
from app.tools.preflight.readings import FAIL, PASS, SKIP, UNCHECKED, WARN, Check, Readings

__all__ = ["FAIL", "PASS", "SKIP", "UNCHECKED", "WARN", "Check", "Readings", "exit_code", "gather_readings", "main",
           "run_checks"]

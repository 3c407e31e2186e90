"""Doctor: the tuning guide's troubleshooting flows, run against a running llm-lanes app (`python -m app.tools.doctor`;
usage, flows and exit codes in app/tools/doctor/cli.py).

Layout: thresholds (the named numbers the checks decide by), model (metric names, parsed inputs, Finding),
checks_oom / checks_throughput / checks_long_tail (the three flows, pure functions of a DoctorInputs record),
checks (all of them in report order, the exit code), inputs (parsing the app's documents; gather_inputs, the only
code that touches the network or files), render (text and JSON), cli.

The entry points other code uses are importable from here.
"""

from app.tools.doctor.checks import exit_code, run_checks
from app.tools.doctor.cli import main
from app.tools.doctor.inputs import gather_inputs, read_span_lines
from app.tools.doctor.model import OK, PROBLEM, WARN, DoctorInputs, Finding

__all__ = ["OK", "PROBLEM", "WARN", "DoctorInputs", "Finding", "exit_code", "gather_inputs", "main",
           "read_span_lines", "run_checks"]

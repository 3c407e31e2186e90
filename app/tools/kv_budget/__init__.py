"""KV-cache budget validator (`python -m app.tools.kv_budget`; usage and the arithmetic in app/tools/kv_budget/cli.py).

Layout: shape (a model's shape and the pure KV arithmetic), budget (one engine's budget: inputs, report, checks, text),
inputs (the serve config, the model's config.json, the GPU's size), shared_gpu (engines sharing one GPU), cli.

The pure functions other code uses are importable from here.
"""

from app.tools.kv_budget.budget import BudgetInputs, BudgetReport, compute_budget
from app.tools.kv_budget.cli import main
from app.tools.kv_budget.shape import ModelShape, kv_bytes_per_token, parameter_count, tokens_fitting

__all__ = ["BudgetInputs", "BudgetReport", "ModelShape", "compute_budget", "kv_bytes_per_token", "main",
           "parameter_count", "tokens_fitting"]

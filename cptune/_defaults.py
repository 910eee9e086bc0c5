"""Defaults the library, the CLI and the planner share: each written once."""

MEMORY_MARGIN = 0.05
"""A configuration fits when its worst measured peak x (1 + this margin) is within the budget (allocator
reserve, fragmentation)."""

BUDGET_FRACTION = 0.9
"""The memory budget when none is given: this share of one GPU's memory (or of RAM / local ranks on CPU),
for a search and a plan alike."""

TRIAL_TIMEOUT_S = 300.0
"""Seconds before a search's trial is taken for a hang."""

"""cptune's exceptions: one base, so callers (and the CLI) can catch everything cptune raises."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


class CPTuneError(Exception):
    """Base of every error cptune raises on purpose. The CLI maps it to a message and exit 1."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the input: the argument it concerns, what is wrong, and the fix."""

    argument: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.argument}: {self.message}. Fix: {self.fix}"


class ValidationError(CPTuneError, ValueError):
    """Bad input, found before any collective. Carries every problem found, not just the first."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems: tuple[Problem, ...] = tuple(problems)
        if not self.problems:
            raise ValueError("ValidationError needs at least one problem")
        if len(self.problems) == 1:
            text = f"cptune: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            text = f"cptune found {len(self.problems)} problems:\n{lines}"
        super().__init__(text)

    def __reduce__(self):  # pickles across processes (ranks report errors to their parent)
        return (type(self), (self.problems,))


def raise_if(problems: list[Problem]) -> None:
    if problems:
        raise ValidationError(problems)


class CPTuneWarning(UserWarning):
    """cptune changed something it was asked to do (e.g. turned load balancing off) and says why."""


class ProblemError(ValueError):
    """Raised inside a pydantic validator: carries the whole Problem (argument and fix) out of it."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.message)
        self.problem = problem

"""The oldest release of each dependency cptune runs on, checked when cptune is imported.

``pyproject.toml`` states the same floors (``tests/test_layout.py`` checks they agree), and
``.ci/floors`` runs the suite on exactly these releases (once per release of cptune, not in CI):
a floor that no longer holds is raised there, never found by a user in the middle of a search.
"""

from __future__ import annotations

from importlib import metadata

FLOORS = {"torch": "2.13", "optuna": "5.0", "pydantic": "2.5", "click": "8.1", "pyyaml": "6.0"}
"""Package (as pip names it) -> the oldest release that runs the suite."""
WHY = {"optuna": "Trial.set_constraint, which the search uses, first shipped in optuna 5.0",
       "torch": "on older releases the suite fails: torch.compile cannot trace cptune's blocks (2.12, 2.10), "
                "and a trained example's loss drifts from one process (2.12) or FSDP2 gradients do (2.7)"}


def version_tuple(text: str) -> tuple[int, int, int]:
    """'2.13.0+cpu' -> (2, 13, 0); missing parts count as 0, and a part's trailing letters ('0rc1') are dropped."""
    parts = []
    for piece in (text.split("+")[0].split(".") + ["0", "0"])[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    return parts[0], parts[1], parts[2]


def too_old() -> list[str]:
    """One line per installed dependency older than its floor, with the command that fixes it."""
    lines = []
    for name, floor in FLOORS.items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # pip installs what pyproject.toml names; a missing one fails at its own import
        if version_tuple(have) < version_tuple(floor):
            why = f" ({WHY[name]})" if name in WHY else ""
            lines.append(f"{name} {have} is older than cptune needs{why}. Fix: pip install '{name}>={floor}'")
    return lines


def check() -> None:
    """Raise ImportError naming every dependency that is too old."""
    lines = too_old()
    if lines:
        raise ImportError("cptune: " + "; ".join(lines))

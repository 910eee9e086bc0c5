"""The support matrix as docs/transformers.md holds it: each cell in a word (:func:`short`), the table, the docs'
markers around each transformers major release's table, and ``cptune/hf/proven.json``'s families (those exact in every
CP cell, which the first-step check takes as proven). ``benchmarks.matrix`` runs the cells."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CP_CELLS = {"ring": ("ring", False), "ulysses": ("ulysses", False), "ring, packed": ("ring", True),
            "ulysses, packed": ("ulysses", True)}
TP_CELL = "tp2·cp2"


def short(cell: dict) -> str:
    """A cell as the docs table says it."""
    status = cell["status"]
    if status == "exact" and cell.get("paths"):  # a hybrid's mixers: the path they took (cptune.mixers._choice)
        return f"exact ({', '.join(cell['paths'])})"
    if status != "refused":
        return {"exact": "exact", "no plan": "no TP plan", "no reference": "one process fails"}.get(status, status)
    text = cell["message"]
    if "which cptune does not split over tp" in text:
        return "refused: token mixing under tp"
    if "first-step check" in text:  # a family cptune has not proven, found wrong on the ranks
        return "refused: first-step check"
    if "sparse-attention indexer" in text:
        return "refused: sparse-attention indexer"
    if "mixes tokens outside attention" in text:
        kinds = sorted(set(re.findall(r"a (\w+) over \d+ positions", text))
                       | set(re.findall(r"config.layer_types '(\w+)'", text)))
        return f"refused: token mixing ({', '.join(kinds)})"
    if "unsplit" in text:
        return "refused: MoE unsplit by TP plan"
    if "column-wise with no row-wise" in text:
        return "refused: TP plan leaves output split"
    if "cannot build it on the meta device" in text:
        return "refused: transformers too old"
    if "TP plan" in text:
        styles = sorted(set(re.findall(r": (\w+)(?:;|\))", text)))
        return f"refused: TP plan ({', '.join(styles)})" if styles else "refused: TP plan"
    if "whose vision-language models cptune does not split" in text:
        return "refused: transformers too old"
    if "whose vision part cptune does not split" in text:
        return "refused: tower not split"
    if "vision rows cptune's support matrix has not proven" in text:
        return "refused: vision unproven"
    if "softcapping" in text:
        return "refused: attention softcapping"
    if "attention implementation" in text or "cannot run under cptune's SDPA" in text:
        return "refused: not SDPA attention"
    return "refused: " + text.split(":", 2)[1].strip()[:40]


def table(matrix: dict[str, dict[str, dict]], version: str, columns: list[str] | None = None,
          classes: str = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES") -> str:
    """The docs' table (markdown) of ``matrix`` (its ``columns``, each family's class from transformers' ``classes``
    mapping)."""
    from transformers.models.auto import modeling_auto

    columns = columns or [*CP_CELLS, TP_CELL]
    lines = [f"| family (transformers {version}) | class | " + " | ".join(columns) + " |",
             "|" + "---|" * (len(columns) + 2)]
    for family, cells in matrix.items():
        name = getattr(modeling_auto, classes).get(family, "")
        lines.append(f"| `{family}` | {name} | " + " | ".join(short(cells[c]) for c in columns if c in cells) + " |")
    return "\n".join(lines)


DOC = ROOT / "docs" / "transformers.md"


def _markers(version: str, rows: str = "matrix") -> tuple[str, str]:
    """The docs' markers around the table of ``version``'s major release (one table for 5.x, one for 4.x); ``rows``:
    "matrix" (benchmarks.matrix) or "matrix_vision" (its vision-language rows)."""
    major = version.split(".", 1)[0]
    what = "matrix" if rows == "matrix" else "vision rows"
    return (f"<!-- {what}, transformers {major}: begin (python -m benchmarks.{rows} --update-docs) -->",
            f"<!-- {what}, transformers {major}: end -->")


def documented(version: str, rows: str = "matrix") -> str | None:
    """The table docs/transformers.md holds for ``version``'s major release (None: none yet)."""
    begin, end = _markers(version, rows)
    text = DOC.read_text()
    if begin not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip()


def proven(matrix: dict[str, dict[str, dict]], cells: Iterable[str] = tuple(CP_CELLS)) -> list[str]:
    """The families exact in every CP cell: what ``cptune.hf``'s first-step check takes as proven."""
    cells = list(cells)
    return sorted(f for f, row in matrix.items() if all(row[c]["status"] == "exact" for c in cells))


def write_proven(matrix: dict[str, dict[str, dict]], version: str, rows: str = "matrix",
                 names: list[str] | None = None) -> None:
    """``cptune/hf/proven.json``'s list for ``version``'s major release, from this run (``names``: the list, when the
    rows say it otherwise; the vision rows' list under "<major>-vision")."""
    from cptune.hf import PROVEN_FILE

    data = json.loads(PROVEN_FILE.read_text()) if PROVEN_FILE.exists() else {}
    major = version.split(".", 1)[0]
    data[major if rows == "matrix" else f"{major}-vision"] = proven(matrix) if names is None else names
    PROVEN_FILE.write_text(json.dumps(dict(sorted(data.items(), reverse=True)), indent=1) + "\n")


def update_docs(text: str, version: str, rows: str = "matrix") -> None:
    begin, end = _markers(version, rows)
    doc = DOC.read_text()
    block = f"{begin}\n{text}\n{end}"
    if begin in doc:
        doc = doc.split(begin, 1)[0] + block + doc.split(end, 1)[1]
    else:
        doc = doc.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(doc)

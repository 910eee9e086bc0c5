"""What ``cptune search`` and ``cptune report`` print: the progress line, the result table and its notes,
and the recipe(s) ``--out`` writes."""

from __future__ import annotations

import json

import click

from ..errors import CPTuneError
from ..sizes import format_rate, format_size


def progress():
    import time

    started = time.monotonic()

    def show(record, done: int, total: int) -> None:
        width = 20
        filled = int(width * done / max(total, 1))
        tps = f"{format_rate(record.tokens_per_s):>10} tok/s" if record.tokens_per_s else " " * 16
        elapsed = time.monotonic() - started
        left = f", ~{duration(elapsed / done * (total - done))} left" if 0 < done < total else ""
        peak = f"peak {format_size(record.peak_bytes)}" if record.peak_bytes else ""
        click.echo(f"[{'#' * filled}{'-' * (width - filled)}] {done}/{total} {duration(elapsed)} elapsed{left} "
                   f"{record.label:<32} {tps} {peak:<16} {record.state}"
                   f"{': ' + record.reason if record.reason else ''}", err=True)
    return show


def duration(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 90 else f"{seconds / 60:.0f}m" if seconds < 5400 else f"{seconds / 3600:.1f}h"


def report_search(results, as_json: bool, out: str | None, script: str | None) -> None:
    """Print a search's results (a table each, or JSON) and write the recipe(s) for ``--out``."""
    from ..recipe import per_length_path, recipe_from_search, save_recipe

    if as_json:
        data = [r.to_dict() for r in results]
        click.echo(json.dumps(data if len(results) > 1 else data[0], indent=2))
    failed = []
    for result in results:
        if not as_json:
            print_result(result)
        if result.best is None:
            failed.append(result)
        elif out:
            target = out if len(results) == 1 else per_length_path(out, result.workload.seq_len)
            path = save_recipe(recipe_from_search(result, script=script), target)
            click.echo(f"recipe written: {path}", err=True)
    if len(results) > 1 and not as_json:
        click.echo("\nbest per sequence length:")
        previous = None
        for r in results:
            label = r.best.label if r.best else "nothing fits"
            change = "" if previous in (None, label) else f"   <- changes (was {previous})"
            click.echo(f"  S={r.workload.seq_len:<8} {label}{change}")
            previous = label
    if failed:
        raise CPTuneError("\n".join(f"S={r.workload.seq_len}: {r.why_nothing()}" if len(results) > 1 else
                                    r.why_nothing() for r in failed))


def print_result(result) -> None:
    click.echo(f"\nstudy {result.study_name} ({result.storage}), {result.world_size} ranks on {result.device}, "
               f"budget per rank {format_size(result.memory_budget)}; {result.evaluated_now} trial(s) run now")
    click.echo(result.table())
    click.echo(f"({result.LEGEND})")
    if result.plan_note():
        click.echo(f"plan: {result.plan_note()}")
    if result.check:
        click.echo(f"check: {result.check}")
    best = result.best
    if best is not None:
        click.echo(f"\nbest: {best.label}  {format_rate(best.tokens_per_s)} tokens/s")
        for kind, note in (("race", result.race_note()), ("tie", result.tie_note()),
                           ("note", result.dp_only_note())):
            if note:
                click.echo(f"{kind}: {note}")
    if not result.complete:
        click.echo("note: not every configuration was tried; rerun the same command to continue", err=True)

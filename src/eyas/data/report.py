"""Printed summaries of the data stage."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from eyas.data.prepare import PrepareStats


def print_prepare_stats(console: Console, stats: PrepareStats, out: Path) -> None:
    """A table of what was read, kept, skipped, dropped and written."""
    table = Table(title=f"prepared {out}", show_header=False)
    table.add_row("records read", f"{stats.records_read:,}")
    for reason, count in sorted(stats.skipped.items()):
        table.add_row(f"  skipped: {reason}", f"{count:,}")
    table.add_row("  exact duplicates removed", f"{stats.duplicates:,}")
    if stats.regeneration:
        regen = stats.regeneration
        table.add_row(
            "regenerated",
            f"{regen['conversations_done']:,} new, {regen['conversations_resumed']:,} resumed, "
            f"{regen['conversations_failed']:,} failed, {regen['answers_truncated']:,} answers cut at max-new-tokens",
        )
    if stats.clipped_for_length:
        table.add_row("  turns past max length not regenerated", f"in {stats.clipped_for_length:,} conversations")
    for reason, count in sorted(stats.dropped.items()):
        table.add_row(f"  dropped: {reason}", f"{count:,}")
    table.add_row("  truncated to max length", f"{stats.truncated:,}")
    table.add_row("samples (train / holdout)", f"{stats.train_samples:,} / {stats.holdout_samples:,}")
    table.add_row("tokens / masked (assistant) tokens", f"{stats.tokens:,} / {stats.masked_tokens:,}")
    if stats.prefix_unstable:
        table.add_row("rendered via offset fallback", f"{stats.prefix_unstable:,} (template is not prefix-stable)")
    table.add_row("wall time", f"{stats.seconds:.1f} s")
    console.print(table)
    for example in stats.skip_examples[:5]:
        console.print(f"  [dim]{example}[/]", soft_wrap=True, highlight=False)

"""`azq bench` commands."""

from __future__ import annotations

import click


@click.group()
def bench() -> None:
    """bench commands."""

"""The command line: parse, call, print. stdout carries data (JSONL); people read stderr."""

from __future__ import annotations

import typer
from rich.console import Console

from .models import REGISTRY

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Lossless speculative decoding for image captioning and VQA with vision-language models.")
err = Console(stderr=True)


@app.command()
def models() -> None:
    """List the short model names recap knows (any local model directory works too)."""
    for alias, repo in REGISTRY.items():
        print(f"{alias}\t{repo}")


def main() -> None:
    app()

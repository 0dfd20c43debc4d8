"""``python -m looptool`` runs the CLI."""

from looptool.cli import main

main()

"""`python -m benchmarks.studies`: see `cli.py`."""

from benchmarks.studies.cli import main

main()

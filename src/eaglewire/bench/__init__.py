"""Benchmarks: run.py (HF generate against eaglewire without and with the draft on a suite), shapes.py (several
speculation shapes in one run), report.py (the table, the JSON and the plots), cli.py (`eaglewire bench`)."""

"""MegaScan's offline analysis of a traced job: clock alignment, the joined span table, the detectors' views,
the folds, and one report of root causes (analysis.py; triage.py for jobs too large for one table, on the per-rank
numbers of features.py).

Imports read/ only. Shared types and statistics (stats, findings, table) at the bottom, one family of evidence per
file above them, analysis.py and triage.py on top (tests/test_scan_imports.py checks the order).
"""

"""MegaScan inside the ranks: the tracer plug-in of engine runs, `scan.instrument()` for any PyTorch job, and the
stage cost model the tracer writes into its header.

Imports read/ (the file format) and, at the end of a run, detect/ (the rank's summary block).
"""

"""MegaScan's synthetic traces with known ground truth: a simulated 3D-parallel job at any scale, and faults
injected into real recordings by causal re-timing. Imports read/ and detect/ (the table's joins, summary blocks).
"""

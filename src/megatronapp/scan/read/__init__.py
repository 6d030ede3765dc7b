"""MegaScan's trace files: the rank-file format (written by record/, read by every other role), the summary block
at a file's end, and readers of a trace directory whatever it holds (ours or PyTorch profiler traces).

At the bottom of scan/: imports no other scan package.
"""

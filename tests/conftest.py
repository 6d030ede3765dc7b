"""Test-wide settings."""
import torch

# Tiny models on a 2-core machine shared with spawned ranks: several intra-op threads per process only contend
# (seen here: tiny matmuls up to 100x slower with 2 threads under load).
torch.set_num_threads(1)  # every test module: the model, TP and HF tests rely on it

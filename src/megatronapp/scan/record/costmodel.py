"""What each pipeline stage SHOULD cost: FLOPs of its chunks, so legitimately heavier stages are not faults.

The first stage holds the embedding, the last the output layer (the h x V logits GEMM, often the largest matmul
of the model) and the loss: with one rank per stage there is no peer doing the same work, and a detector that
assumed equal stages would blame the last stage of every healthy pure-pipeline job with a large vocabulary.
`stage_work` gives the expected relative cost of each stage; the trace header carries it (`stage_work`) and
`scan/detect/structure.py` divides each stage's time by it before comparing stages.

FLOPs per token, forward + backward (3x the forward), from the one FLOP model (flops.py, which
`ModelConfig.flops_per_token` uses: PaLM, appendix B): 6 per weight in a matmul plus 12*L*H*Q*T of attention
scores, per chunk instead of per model.
Beyond what PaLM counts (it counts model FLOPs for MFU), two terms that take real time on the stages that hold
them: the embedding's backward (a scatter-add of each token's gradient row) and the loss (softmax and
cross-entropy over V logits, forward and backward).
"""
from __future__ import annotations

from megatronapp.flops import ModelShape, layer_flops_per_token, output_weights
from megatronapp.partition import split_layers

_EMBED_FLOPS_PER_WIDTH = 4.0  # lookup + gradient scatter-add (and position embedding): ~4 per token and feature
_LOSS_FLOPS_PER_LOGIT = 8.0  # max, subtract, exp, sum, divide forward; softmax minus one-hot backward


def chunk_flops_per_token(model: ModelShape, seq_len: int, layers: int, first: bool, last: bool) -> float:
    """Forward + backward FLOPs per token of one pipeline chunk of `layers` layers."""
    out = layers * layer_flops_per_token(model, seq_len)
    if first:
        out += _EMBED_FLOPS_PER_WIDTH * model.hidden_size
    if last:
        out += 6.0 * output_weights(model) + _LOSS_FLOPS_PER_LOGIT * model.vocab_size
    return out


def stage_work(model: ModelShape, pp: int, vpp: int, seq_len: int) -> list[float]:
    """Expected cost of each pipeline stage relative to the mean stage (1.0 = average), from FLOPs."""
    ranges = split_layers(model.num_layers, pp, vpp)
    n = len(ranges)
    work = [0.0] * pp
    for v, (a, b) in enumerate(ranges):  # virtual stage v runs on pipeline rank v % pp
        work[v % pp] += chunk_flops_per_token(model, seq_len, b - a, v == 0, v == n - 1)
    mean = sum(work) / pp
    return [round(w / mean, 6) for w in work]

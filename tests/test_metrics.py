"""Peak FLOP/s and MFU, peak memory, the progress line, and the JSONL metrics log."""
from __future__ import annotations

import io
import json

import pytest
import torch

from megatronapp.config import ModelConfig
from megatronapp.train.metrics import (
    MetricsLog,
    Progress,
    measure_peak_flops,
    mfu,
    mfu_denominator,
    peak_memory_bytes,
    read_metrics,
)


def test_measure_peak_flops_on_cpu():
    fp32 = measure_peak_flops("cpu", torch.float32, seconds=0.05)
    bf16 = measure_peak_flops(torch.device("cpu"), "bf16", seconds=0.05)
    # Any CPU does between 100 MFLOP/s and 100 TFLOP/s of 512x512 matmul.
    assert 1e8 < fp32 < 1e14 and 1e8 < bf16 < 1e14
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        measure_peak_flops("cpu", "fp8", seconds=0.01)


def test_mfu_arithmetic():
    # 1000 tok/s * 6e9 FLOP/token = 6 TFLOP/s achieved over 4 ranks of 3 TFLOP/s peak.
    assert mfu(1000.0, 6e9, 3e12, 4) == pytest.approx(0.5)
    assert mfu(1000.0, 6e9, 0.0, 4) == 0.0


def test_flops_per_token_counts_as_palm_without_embedding_lookups():
    # PaLM appendix B: 6N + 12*L*H*Q*T, N = matmul weights. Lookups (token, position) are not matmuls; the
    # h x V output projection is, and counts once whether or not it shares the input embedding's weights.
    gpt2 = ModelConfig(family="gpt2", vocab_size=256, hidden_size=128, num_layers=4, num_heads=4, max_seq_len=128)
    # per layer: QKV 128*384 + out 128*128 = 65,536; MLP 2*128*512 = 131,072; 4 layers = 786,432
    # output projection 128*256 = 32,768 -> N = 819,200; attention 12*4*(4*32)*64 = 393,216
    assert gpt2.flops_per_token(64) == 6 * 819_200 + 393_216 == 5_308_416
    llama = ModelConfig(family="llama", vocab_size=256, hidden_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, max_seq_len=128)
    # ffn 32*ceil(341/32) = 352; per layer: Q 128*128 + KV 128*2*64 + out 128*128 = 49,152; SwiGLU 3*128*352 =
    # 135,168; 2 layers = 368,640; untied output 128*256 = 32,768 (the input table is a lookup) -> N = 401,408
    assert llama.ffn_hidden_size == 352 and not llama.tie_embeddings
    assert llama.flops_per_token(64) == 6 * 401_408 + 12 * 2 * 128 * 64 == 2_605_056
    # tying changes parameters, not FLOPs; num_params keeps its meaning (both tables, positions included)
    tied = ModelConfig(family="llama", vocab_size=256, hidden_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, max_seq_len=128, tie_embeddings=True)
    assert tied.flops_per_token(64) == llama.flops_per_token(64)
    assert llama.num_params() - tied.num_params() == 32_768
    assert gpt2.num_params() == 819_200 + 128 * 128  # + learned positions


def test_mfu_denominator_names_its_source():
    peak, what, vendor = mfu_denominator(989.0, "cpu", "bf16")
    assert peak == 989e12 and vendor and what == "vendor peak 989 TFLOP/s per rank (--peak-tflops)"
    peak, what, vendor = mfu_denominator(None, "cpu", "fp32")
    assert 1e8 < peak < 1e14 and not vendor
    assert what.startswith("measured matmul ") and "float32 on cpu" in what and "--peak-tflops" in what
    out = io.StringIO()
    Progress(2, True, stream=out, mfu_measured=True).update(1, 5.0, 100.0, 0.5, 1, 1e-3)
    Progress(2, True, stream=out).update(1, 5.0, 100.0, 0.5, 1, 1e-3)
    measured, vendor_line = out.getvalue().splitlines()
    assert "MFU 50.0% (measured peak) |" in measured and "MFU 50.0% |" in vendor_line


def test_peak_memory_bytes_cpu_is_in_bytes_and_never_falls():
    before = peak_memory_bytes("cpu")
    assert before > 10 * 2**20  # a Python process with torch loaded holds well over 10 MiB
    big = torch.ones(96 * 2**20 // 4)  # 96 MiB, written so the pages are resident
    after = peak_memory_bytes("cpu")
    del big
    assert after >= before and after > 96 * 2**20


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(progress: Progress, steps: int) -> None:
    for s in range(1, steps + 1):
        progress.update(s, loss=5.1 - s * 0.1, tokens_per_s=1234.5, mfu=0.123, mem_bytes=3 * 2**20, lr=1e-3)
    progress.close({"steps": steps, "final_loss": 4.1, "tokens_per_s": 1234.5})


def test_progress_plain_lines_every_n_steps():
    out = io.StringIO()
    _run(Progress(10, True, stream=out, every=4), 10)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # Step 1 (first), 4, 8, and 10 (last), then the summary.
    assert [ln.split()[1] for ln in lines[:-1]] == ["1/10", "4/10", "8/10", "10/10"]
    assert "loss 4.1000" in lines[3] and "MFU 12.3%" in lines[3] and "1,234 tok/s" in lines[3]
    assert "mem 3.0MiB" in lines[3] and "lr 1.00e-03" in lines[3]
    assert lines[-1].startswith("done:") and "final_loss=4.1" in lines[-1] and "steps=10" in lines[-1]


def test_progress_live_bar_on_a_tty():
    out = _Tty()
    _run(Progress(5, True, stream=out), 5)
    text = out.getvalue()
    assert text.count("\r") == 5
    bar, summary = text.rstrip("\n").rsplit("\n", 1)
    assert "\n" not in bar  # redrawn in place, one line
    assert "[########################] 5/5" in bar.split("\r")[-1]
    assert summary.startswith("done:")


def test_progress_disabled_prints_nothing():
    out = _Tty()
    _run(Progress(5, False, stream=out), 5)
    assert out.getvalue() == ""


def test_metrics_log_appends_flushed_json_lines(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLog(path)
    log.log({"step": 0, "loss": torch.tensor(2.5), "lr": 1e-3})
    # Readable before close: each line is flushed as it is written.
    assert json.loads(path.read_text().splitlines()[0]) == {"step": 0, "loss": 2.5, "lr": 1e-3}
    log.log({"step": 1, "loss": float("nan"), "extra": {"grad_norm": float("inf")}})
    log.close()
    with MetricsLog(path) as again:  # a resumed run appends
        again.log({"step": 2, "loss": 2.0})
    with path.open("a") as f:
        f.write('{"step": 3, "lo')  # a crash mid-line
    records = read_metrics(path)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[1]["loss"] == "nan" and records[1]["extra"] == {"grad_norm": "inf"}


def test_progress_eta_counts_only_steps_run_since_start(monkeypatch):
    from megatronapp.train import metrics

    clock = iter([100.0, 110.0])  # built at t=100; the first update, at t=110, is step 91 of a resumed run
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock, 110.0))
    out = io.StringIO()
    p = Progress(100, True, stream=out, every=1)
    p.update(91, loss=1.0, tokens_per_s=1.0, mfu=0.0, mem_bytes=0, lr=0.0)
    # One step in 10 s since the start, 9 steps left: 1:30 remaining (not 10 s / 91 steps * 9).
    assert "0:10<1:30" in out.getvalue()

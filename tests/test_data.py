"""Embedded corpus, tokenizers, text loading, and per-DP-rank batches."""
from __future__ import annotations

import gc
import json
import re
import threading
import time

import pytest
import torch

from megatronapp.config import ConfigError, RunConfig
from megatronapp.data import (
    BatchSource,
    ByteTokenizer,
    DataError,
    HFTokenizer,
    build_batch_source,
    embedded_corpus,
    load_text,
    load_tokenizer,
    split_microbatches,
)
from megatronapp.data.corpus import DAYS, MONTHS, NUMBER_WORDS, generate
from megatronapp.data.prefetch import DataWorkerError, Prefetcher

# ---------------------------------------------------------------- corpus


def test_corpus_is_deterministic_ascii_and_sized():
    text = embedded_corpus()
    assert text == generate(), "the embedded corpus must not depend on anything but its seed"
    assert generate(seed=1, target_chars=5000) != generate(seed=2, target_chars=5000)
    assert 200_000 <= len(text.encode()) <= 1_000_000
    assert text.isascii()


def test_corpus_sentences_are_true():
    # The model is meant to learn these; a wrong sum or day order in the data would teach it nonsense.
    text = embedded_corpus()
    sums = re.findall(r"(\d) ([+-]) (\d) = (\d+)\.", text)
    assert len(sums) > 1000
    for a, op, b, c in sums:
        assert (int(a) + int(b) if op == "+" else int(a) - int(b)) == int(c)
    days = re.findall(r"After (\w+day) comes (\w+day)\.", text)
    assert len(days) > 100
    for a, b in days:
        assert DAYS.index(b) == (DAYS.index(a) + 1) % 7
    months = re.findall(r"After (\w+) comes (\w+)\.", text)
    for a, b in months:
        if a in MONTHS:
            assert MONTHS.index(b) == (MONTHS.index(a) + 1) % 12
    for a, b, c in re.findall(r"([A-Z][a-z]+) plus (\w+) is (\w+)\.", text):
        assert NUMBER_WORDS.index(a.lower()) + NUMBER_WORDS.index(b) == NUMBER_WORDS.index(c)
    stories = re.findall(r"(\w+) has (\d) \w+\. \w+ gives \w+ (\d) more\. Now (\w+) has (\d+)", text)
    assert len(stories) > 100
    for who, a, b, who2, c in stories:
        assert who == who2 and int(a) + int(b) == int(c)


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_and_bad_bytes():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    text = "After Monday comes Tuesday. naïve ∑"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.encode_tensor(text).tolist() == ids
    assert tok.decode([0xE2, 0x88]) == "\ufffd"  # a cut multi-byte character is replaced, never raises


def _write_hf_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sees the dog", "after monday comes tuesday"] * 20,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    tok.save(str(path))
    return tok


def test_hf_tokenizer_file_and_directory(tmp_path):
    ref = _write_hf_tokenizer(tmp_path / "tokenizer.json")
    for spec in (str(tmp_path / "tokenizer.json"), str(tmp_path)):
        tok = load_tokenizer(spec)
        assert isinstance(tok, HFTokenizer)
        assert tok.vocab_size == ref.get_vocab_size()
        ids = tok.encode("the cat sees the dog")
        assert ids == ref.encode("the cat sees the dog").ids
        assert tok.decode(ids).replace(" ", "") == "thecatseesthedog"
        assert tok.encode_tensor("the cat\nthe dog\n").tolist() == tok.encode("the cat") + tok.encode("the dog")


def test_hf_tokenizer_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere"):
        HFTokenizer(tmp_path / "nothere.json")
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        load_tokenizer(str(tmp_path))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        HFTokenizer(bad)


# ---------------------------------------------------------------- loading text


def test_load_text_txt_jsonl_and_directory(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_text(json.dumps({"text": "doc one"}) + "\n\n"
                                              + json.dumps({"text": "doc two", "id": 3}) + "\n")
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    assert load_text(tmp_path / "a.txt") == "hello world"
    assert load_text(tmp_path / "sub" / "b.jsonl") == "doc one\n\ndoc two"
    assert load_text(tmp_path) == "hello world\n\ndoc one\n\ndoc two"


@pytest.mark.parametrize("line, why", [("{oops", "not valid JSON"), ('{"txt": "x"}', "string field"),
                                       ('["text"]', "string field"), ('{"text": 5}', "string field")])
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, why):
    p = tmp_path / "data.jsonl"
    p.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=rf"data\.jsonl:2: .*{why}"):
        load_text(p)


def test_load_text_refuses_missing_unknown_and_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_text(tmp_path / "missing.txt")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="x.csv"):
        load_text(tmp_path / "x.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .txt or .jsonl"):
        load_text(tmp_path / "empty")


# ---------------------------------------------------------------- batches


def _tokens(n: int = 1000) -> torch.Tensor:
    # Token i has value i, so a row's first token tells where its window starts.
    return torch.arange(n)


def test_batch_shapes_and_shifted_labels():
    src = BatchSource(_tokens(), seq_len=16, global_batch=6, seed=3)
    x, y = src.get(0)
    assert x.shape == y.shape == (6, 16) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Every row is a window starting at a multiple of seq_len.
    tokens = _tokens()
    for row_x, row_y in zip(x, y):
        start = int(row_x[0])
        assert start % 16 == 0
        assert torch.equal(row_x, tokens[start:start + 16]) and torch.equal(row_y, tokens[start + 1:start + 17])


def test_batches_depend_only_on_seed_and_step():
    a = BatchSource(_tokens(), 16, 4, seed=7)
    b = BatchSource(_tokens(), 16, 4, seed=7)
    # A resumed run asks for step 37 first; it must see what the uninterrupted run saw.
    seen = [a.get(s)[0] for s in range(40)]
    assert torch.equal(b.get(37)[0], seen[37])
    assert torch.equal(b.get(3)[0], seen[3])
    assert not torch.equal(BatchSource(_tokens(), 16, 4, seed=8).get(0)[0], seen[0])


def test_each_epoch_visits_every_window_once_in_a_new_order():
    src = BatchSource(_tokens(), 10, 3, seed=0)
    n = src.num_windows
    assert n == (1000 - 1) // 10
    epoch0 = [src.window_index(s) for s in range(n)]
    epoch1 = [src.window_index(s) for s in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    assert epoch0 != epoch1 and epoch0 != list(range(n))


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_ranks_get_disjoint_rows_that_make_the_global_batch(dp):
    whole = BatchSource(_tokens(), 8, 8, seed=5)
    for step in (0, 1, 30):
        parts = [BatchSource(_tokens(), 8, 8, dp_rank=d, dp=dp, seed=5).get(step) for d in range(dp)]
        assert all(x.shape == (8 // dp, 8) for x, _ in parts)
        gx, gy = whole.get(step)
        assert torch.equal(torch.cat([x for x, _ in parts]), gx)
        assert torch.equal(torch.cat([y for _, y in parts]), gy)


def test_batch_source_refuses_bad_arguments():
    with pytest.raises(ValueError, match="fewer than one window"):
        BatchSource(_tokens(16), seq_len=16, global_batch=1)
    BatchSource(_tokens(17), seq_len=16, global_batch=1).get(5)  # exactly one window is enough
    with pytest.raises(ValueError, match="not divisible by dp=4"):
        BatchSource(_tokens(), 8, 6, dp_rank=0, dp=4)
    with pytest.raises(ValueError, match="dp_rank=2"):
        BatchSource(_tokens(), 8, 4, dp_rank=2, dp=2)


# ---------------------------------------------------------------- prefetch


def _prefetch_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("data-prefetch")}


@pytest.mark.parametrize("depth", [1, 3])
def test_prefetched_batches_equal_direct_ones_from_any_start(depth):
    src = BatchSource(_tokens(250), 10, 4, seed=3)
    direct = BatchSource(_tokens(250), 10, 4, seed=3)
    # from a resumed step, across an epoch boundary (24 windows, 4 rows a step: epoch 1 starts at step 6)
    built = []

    def make(step):
        built.append(step)
        return src.get(step)

    pf = Prefetcher(make, start=4, depth=depth)
    try:
        for step in range(4, 12):
            x, y = pf.get(step)
            dx, dy = direct.get(step)
            assert torch.equal(x, dx) and torch.equal(y, dy), step
        time.sleep(0.05)
        assert built == list(range(4, 12 + depth)), "the worker must build exactly `depth` steps ahead"
        with pytest.raises(ValueError, match="expected step 12, was asked for step 3"):
            pf.get(3)
    finally:
        pf.close()
    assert not pf.alive


def test_worker_error_surfaces_in_the_caller_naming_the_step():
    src = BatchSource(_tokens(), 10, 4, seed=3)

    def make(step):
        if step == 6:
            raise OSError("disk went away")
        return src.get(step)

    before = _prefetch_threads()
    pf = Prefetcher(make, start=5, depth=2)
    pf.get(5)
    with pytest.raises(DataWorkerError, match=r"batch of step 6: OSError: disk went away"):
        pf.get(6)
    assert not pf.alive and _prefetch_threads() <= before


def test_close_and_garbage_collection_stop_a_blocked_worker():
    src = BatchSource(_tokens(), 10, 4, seed=3)
    before = _prefetch_threads()
    pf = Prefetcher(src.get, start=0, depth=1)
    time.sleep(0.05)  # the worker fills its one slot and waits for another
    assert pf.alive
    pf.close()
    pf.close()  # idempotent
    assert not pf.alive
    dropped = Prefetcher(src.get, start=0, depth=1)  # never closed: collecting it stops the worker
    thread = next(iter(_prefetch_threads() - before))
    del dropped
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()
    with pytest.raises(ValueError, match="depth 0 must be >= 1"):
        Prefetcher(src.get, start=0, depth=0)


def test_split_microbatches():
    x, y = torch.arange(24).view(6, 4), torch.arange(24).view(6, 4) + 1
    mbs = split_microbatches(x, y, 3)
    assert len(mbs) == 3 and all(a.shape == (2, 4) and b.shape == (2, 4) for a, b in mbs)
    assert torch.equal(torch.cat([a for a, _ in mbs]), x) and torch.equal(torch.cat([b for _, b in mbs]), y)
    with pytest.raises(ValueError, match="6 rows .* 4 equal"):
        split_microbatches(x, y, 4)


# ---------------------------------------------------------------- wiring a run's config


def test_build_batch_source_default_is_embedded_corpus():
    cfg = RunConfig()
    cfg.train.global_batch_size, cfg.parallel.dp = 4, 2
    src, tok = build_batch_source(cfg, dp_rank=1)
    assert isinstance(tok, ByteTokenizer)
    x, _ = src.get(0)
    assert x.shape == (2, cfg.train.seq_len)
    assert src.tokens.numel() == len(embedded_corpus().encode())
    assert tok.decode(x[0].tolist()) in embedded_corpus()


def test_build_batch_source_with_files_and_errors(tmp_path):
    _write_hf_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": "the cat sees the dog " * 20})
                                                for _ in range(5)))
    cfg = RunConfig()
    cfg.train.data, cfg.train.tokenizer, cfg.train.seq_len = str(tmp_path / "d.jsonl"), str(tmp_path), 8
    src, tok = build_batch_source(cfg, 0)
    assert isinstance(tok, HFTokenizer) and int(src.get(0)[0].max()) < tok.vocab_size

    cfg.model.vocab_size = 16
    with pytest.raises(ConfigError, match=r"model.vocab_size=16.*>= \d+"):
        build_batch_source(cfg, 0)
    cfg.model.vocab_size = 256
    cfg.train.tokenizer = str(tmp_path / "none.json")
    with pytest.raises(ConfigError, match="train.tokenizer.*none.json"):
        build_batch_source(cfg, 0)
    cfg.train.tokenizer, cfg.train.data = "byte", str(tmp_path / "absent")
    with pytest.raises(ConfigError, match="train.data.*absent"):
        build_batch_source(cfg, 0)
    (tmp_path / "short.txt").write_text("too short")
    cfg.train.data, cfg.train.seq_len = str(tmp_path / "short.txt"), 64
    with pytest.raises(ConfigError, match="short.txt has 9 tokens.*train.seq_len"):
        build_batch_source(cfg, 0)

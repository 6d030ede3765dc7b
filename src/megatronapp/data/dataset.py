"""Training text to batches: load .txt/.jsonl, tokenize once, cut into windows, deal rows to DP ranks.

A sample is a window of seq_len+1 tokens starting at a multiple of seq_len; input is its first seq_len tokens
and the label its last seq_len. Each epoch visits every window once in an order drawn from (seed, epoch), so
the batch of a step is a pure function of (seed, step): a resumed run sees exactly the data it would have
seen, and every DP rank can compute its own rows without talking to the others.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from megatronapp.config import ConfigError, RunConfig
from megatronapp.data.corpus import embedded_corpus, embedded_validation
from megatronapp.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXT_SUFFIXES = (".txt", ".jsonl")
DOC_SEPARATOR = "\n\n"


class DataError(ValueError):
    """Training data that cannot be used; the message names the file (and line) and the fix."""


def _read_jsonl(path: Path) -> list[str]:
    docs = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 (byte {e.start} of the line is {raw[e.start]:#04x}); "
                                f"save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be an object "
                                 f"like {{\"text\": \"...\"}}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise DataError(f"{path}:{lineno}: expected an object with a string field \"text\"")
            docs.append(obj["text"])
    return docs


def _read_file(path: Path) -> list[str]:
    if path.suffix == ".txt":
        return [path.read_text(encoding="utf-8", errors="replace")]
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    raise DataError(f"data file {path} has suffix {path.suffix!r}; use .txt or .jsonl")


def load_text(path: str | Path) -> str:
    """Text of a .txt file, the "text" fields of a .jsonl file, or all such files under a directory."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        if not files:
            raise DataError(f"data directory {p} holds no .txt or .jsonl files")
    elif p.is_file():
        files = [p]
    else:
        raise FileNotFoundError(f"data path {p} does not exist; give a .txt/.jsonl file or a directory of them")
    docs = [doc for f in files for doc in _read_file(f)]
    return DOC_SEPARATOR.join(docs)


class BatchSource:
    """This DP rank's rows of the global batch of any step, as (input_ids, labels)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, dp_rank: int = 0, dp: int = 1,
                 seed: int = 0):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if dp < 1 or not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp={dp})")
        if global_batch % dp:
            raise ValueError(f"global batch {global_batch} is not divisible by dp={dp}")
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"the training text has {tokens.numel()} tokens, fewer than one window of "
                             f"seq_len+1 = {seq_len + 1}; give more text or lower train.seq_len")
        self.tokens = tokens.long()
        self.seq_len, self.global_batch, self.dp_rank, self.dp, self.seed = seq_len, global_batch, dp_rank, dp, seed
        self.local_batch = global_batch // dp
        self.num_windows = (tokens.numel() - 1) // seq_len
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def _order(self, epoch: int) -> torch.Tensor:
        # One permutation is cached: steps run in order, so an epoch is asked for many times in a row.
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_windows, generator=g)
            self._perm_epoch = epoch
        return self._perm

    def window_index(self, sample: int) -> int:
        """Which window the global sample number `sample` reads."""
        epoch, pos = divmod(sample, self.num_windows)
        return int(self._order(epoch)[pos])

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), each [global_batch // dp, seq_len]; labels are the inputs shifted by one."""
        first = step * self.global_batch + self.dp_rank * self.local_batch
        starts = torch.tensor([self.window_index(s) * self.seq_len for s in range(first, first + self.local_batch)])
        rows = self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def split_microbatches(input_ids: torch.Tensor, labels: torch.Tensor,
                       m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a batch into `m` equal microbatches along the batch dimension."""
    b = input_ids.shape[0]
    if m < 1 or b % m:
        raise ValueError(f"a batch of {b} rows cannot be split into {m} equal microbatches")
    return list(zip(input_ids.chunk(m), labels.chunk(m)))


def build_batch_source(cfg: RunConfig, dp_rank: int) -> tuple[BatchSource, ByteTokenizer | HFTokenizer]:
    """The batch source and tokenizer a run's config asks for (train.data None: the embedded corpus)."""
    t = cfg.train
    try:
        tok = load_tokenizer(t.tokenizer)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"train.tokenizer: {e}") from None
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"train.tokenizer={t.tokenizer!r} has {tok.vocab_size} tokens but model.vocab_size="
                          f"{cfg.model.vocab_size}; set model.vocab_size >= {tok.vocab_size} (any size: it is "
                          f"padded for tensor parallelism)")
    try:
        text = embedded_corpus() if t.data is None else load_text(t.data)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"train.data: {e}") from None
    tokens = tok.encode_tensor(text)
    where = "the embedded corpus" if t.data is None else t.data
    if tokens.numel() < t.seq_len + 1:
        raise ConfigError(f"train.data: {where} has {tokens.numel()} tokens, fewer than one window of "
                          f"train.seq_len+1 = {t.seq_len + 1}; give more text or lower train.seq_len")
    if cfg.parallel.dp < 1 or t.global_batch_size % cfg.parallel.dp:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} must be divisible by "
                          f"parallel.dp={cfg.parallel.dp}")
    source = BatchSource(tokens, t.seq_len, t.global_batch_size, dp_rank, cfg.parallel.dp, t.seed)
    return source, tok


def build_valid_source(cfg: RunConfig, dp_rank: int, tok: ByteTokenizer | HFTokenizer) -> BatchSource:
    """The held-out split's batches (train.valid_data, or the embedded corpus's held-out text), cut like training
    batches: global_batch_size windows of seq_len per evaluation batch, dealt to DP ranks the same way."""
    t = cfg.train
    try:
        text = embedded_validation() if t.valid_data is None else load_text(t.valid_data)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"train.valid_data: {e}") from None
    tokens = tok.encode_tensor(text)
    if tokens.numel() < t.seq_len + 1:
        where = "the embedded held-out text" if t.valid_data is None else t.valid_data
        raise ConfigError(f"train.valid_data: {where} has {tokens.numel()} tokens, fewer than one window of "
                          f"train.seq_len+1 = {t.seq_len + 1}; give more text or lower train.seq_len")
    return BatchSource(tokens, t.seq_len, t.global_batch_size, dp_rank, cfg.parallel.dp, t.seed)

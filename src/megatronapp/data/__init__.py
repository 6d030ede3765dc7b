"""Training data: the embedded corpus, tokenizers, and per-DP-rank batches."""
from megatronapp.data.corpus import embedded_corpus
from megatronapp.data.dataset import BatchSource, DataError, build_batch_source, load_text, split_microbatches
from megatronapp.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["BatchSource", "ByteTokenizer", "DataError", "HFTokenizer", "build_batch_source", "embedded_corpus",
           "load_text", "load_tokenizer", "split_microbatches"]

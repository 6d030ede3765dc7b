"""Export a trained model as a Hugging Face directory (`megatronapp export CKPT --hf OUT`).

The checkpoint of any layout (tp/pp/vpp/dp, ZeRO-1) is consolidated into one model with the real vocabulary
(`train/consolidate.py`); each tensor is then renamed and laid out as transformers' GPT2LMHeadModel or
LlamaForCausalLM expects it: exactly the inverse of `model/hf.py`'s loading (Conv1D weights transposed back, the
fused group-ordered qkv split into q, k and v). The directory gets `config.json`, `model.safetensors`, and the
tokenizer as `tokenizer.json` with `tokenizer_config.json`: the run's own tokenizer.json, or for the byte
tokenizer a byte-level vocabulary of 256 tokens whose id is the byte, so ids equal the run's.

The source may also be an exported (or any local Hugging Face GPT-2/Llama) directory: it is loaded through
`model/hf.py`, so exporting an export again reproduces its tensors bit for bit.

What a source names is data: the tokenizer exported is one this process reads and parses as a tokenizer.json
(the user's `--tokenizer`, a source HF directory's own, or the byte tokenizer's embedded one) and writes out from
what it parsed; a checkpoint's saved tokenizer path is never opened unless the user names it. Outputs are created
fresh (`files.replace_with`): a symlink or hard link at OUT/config.json is replaced, not written through, and a
stale `model.safetensors.index.json` (and the `model-NNNNN-of-NNNNN.safetensors` shards beside it) is removed,
since loaders prefer an index to the single file written now.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from megatronapp.config import ConfigError, ModelConfig
from megatronapp.files import replace_with, write_exclusive
from megatronapp.model.attention import split_qkv

TOKENIZER_FILE = "tokenizer.json"
_STALE = re.compile(r"model\.safetensors\.index\.json|model-\d+-of-\d+\.safetensors")  # an earlier sharded export


class ExportError(ConfigError):
    """A checkpoint that cannot be exported as asked; the message names the setting and the way out."""


def _is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and not (path / "meta.json").is_file()


def load_weights(path: str | Path, tokenizer: str | None = None
                 ) -> tuple[ModelConfig, dict[str, torch.Tensor], str | Path]:
    """(model config, full unpadded state dict in our names, tokenizer spec) of a trainer checkpoint (any layout;
    a step directory, `.../checkpoints/latest` or a run directory) or of a local Hugging Face directory.
    `tokenizer`: the user's; without one, an HF directory's own tokenizer.json, a checkpoint's only when its run
    used the byte tokenizer (a saved path is not opened on the checkpoint's word)."""
    p = Path(path)
    if _is_hf_dir(p):
        from megatronapp.model.hf import load_hf_model
        from megatronapp.model.transformer import unpadded_state_dict

        cfg, model = load_hf_model(p)
        own = p if (p / TOKENIZER_FILE).is_file() else "byte"
        return cfg, unpadded_state_dict(model), tokenizer if tokenizer is not None else own
    from megatronapp.train import checkpoint as ckpt
    from megatronapp.train.consolidate import checkpoint_config, consolidate, tokenizer_spec

    d = ckpt.resolve(p)
    _, run = checkpoint_config(d)
    spec = tokenizer_spec(d, run, tokenizer)  # before the weights are read: refused at once
    cfg, state = consolidate(d)
    return cfg, state, spec


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' config.json for `cfg` (the inverse of `model.hf.config_from_hf`)."""
    if cfg.parallel_block:
        raise ExportError("model.parallel_block=true has no transformers GPT-2/Llama counterpart (attention and MLP "
                          "from one norm); export a model trained without --parallel-block")
    if cfg.sliding_window is not None:
        raise ExportError(f"model.sliding_window={cfg.sliding_window} has no transformers GPT-2/Llama counterpart; "
                          f"export a model trained without --sliding-window")
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": bool(cfg.tie_embeddings),
              "torch_dtype": "float32", "use_cache": True,
              "bos_token_id": None, "eos_token_id": None}  # the byte tokenizer has no special tokens
    if cfg.family == "gpt2":
        if not cfg.bias:
            raise ExportError("a GPT-2 model without biases (model.bias=false) has no transformers counterpart")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": cfg.hidden_size,
                "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "n_inner": cfg.ffn_hidden_size,
                "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps,
                "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "scale_attn_weights": True, **common}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "hidden_act": "silu", "attention_bias": bool(cfg.bias),
            "mlp_bias": bool(cfg.bias), "attention_dropout": 0.0, **common}


_GPT2_NAMES = {"norm1": "ln_1", "norm2": "ln_2", "attn.proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc",
               "mlp.fc2": "mlp.c_proj"}
_LLAMA_NAMES = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm", "attn.proj": "self_attn.o_proj",
                "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}


def hf_tensors(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full state dict -> transformers' tensor names and layouts (contiguous fp32 copies)."""
    out: dict[str, torch.Tensor] = {}
    gpt2 = cfg.family == "gpt2"
    body = "transformer." if gpt2 else "model."
    for name, t in state.items():
        t = t.detach().float()
        if name == "embedding.word.weight":
            out[body + ("wte.weight" if gpt2 else "embed_tokens.weight")] = t
        elif name == "embedding.position.weight":
            out[body + "wpe.weight"] = t
        elif name == "output.weight":
            if not cfg.tie_embeddings:  # tied: transformers ties lm_head to the input embedding itself
                out["lm_head.weight"] = t
        elif name.startswith("final_norm."):
            out[body + ("ln_f." if gpt2 else "norm.") + name.rsplit(".", 1)[1]] = t
        else:
            _, i, rest = name.split(".", 2)
            module, leaf = rest.rsplit(".", 1)
            base = f"{body}h.{i}." if gpt2 else f"{body}layers.{i}."
            if module == "attn.qkv":
                q, k, v = split_qkv(t, cfg.num_heads, cfg.num_kv_heads)
                if gpt2:  # one Conv1D c_attn, weight stored [in, out]
                    qkv = torch.cat([q, k, v], dim=0)
                    out[f"{base}attn.c_attn.{leaf}"] = qkv.t() if leaf == "weight" else qkv
                else:
                    for x, part in zip("qkv", (q, k, v)):
                        out[f"{base}self_attn.{x}_proj.{leaf}"] = part
            elif gpt2:
                conv = leaf == "weight" and module not in ("norm1", "norm2")
                out[f"{base}{_GPT2_NAMES[module]}.{leaf}"] = t.t() if conv else t
            else:
                out[f"{base}{_LLAMA_NAMES[module]}.{leaf}"] = t
    return {k: v.contiguous().clone() for k, v in out.items()}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what the `tokenizers` ByteLevel steps use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json() -> str:
    """tokenizer.json of the byte tokenizer: byte b is token id b, no merges, no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str(pretty=True)


def _tokenizer_json(spec: str | Path, cfg: ModelConfig) -> str:
    """tokenizer.json text to export: the byte tokenizer's, or the one at `spec` read, parsed and written back
    from what was parsed (a file that is no tokenizer is refused, whatever it is or links to)."""
    if str(spec) == "byte":
        return byte_tokenizer_json()
    from megatronapp.data.tokenizer import HFTokenizer

    try:
        tok = HFTokenizer(spec)
    except (OSError, ValueError) as e:
        raise ExportError(f"the tokenizer to export: {e}") from None
    if tok.vocab_size > cfg.vocab_size:
        raise ExportError(f"tokenizer {tok.path} has {tok.vocab_size} tokens, more than the model's vocabulary of "
                          f"{cfg.vocab_size}: it is not this model's tokenizer; pass the one it was trained with")
    return tok.to_json()


def _remove_stale(out: Path) -> list[str]:
    """Remove an earlier sharded export's index and shards from `out` (loaders would prefer them to the file
    written now); the names removed."""
    gone = []
    for p in sorted(out.iterdir()):
        if _STALE.fullmatch(p.name) and (p.is_file() or p.is_symlink()):
            p.unlink()
            gone.append(p.name)
    return gone


def export_hf(src: str | Path, out: str | Path, tokenizer: str | None = None) -> Path:
    """Write the Hugging Face directory `out` for the checkpoint (or HF directory) `src`; returns `out`.
    `tokenizer`: the tokenizer.json to export (a checkpoint trained with one needs it named)."""
    from safetensors.torch import save_file

    cfg, state, spec = load_weights(src, tokenizer)
    config = hf_config(cfg)
    tok_json = _tokenizer_json(spec, cfg)  # read and checked before anything is written
    tensors = hf_tensors(cfg, state)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--hf {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    replace_with(out / "model.safetensors", lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    write_exclusive(out / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    write_exclusive(out / TOKENIZER_FILE, tok_json.encode())
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len,
                  "clean_up_tokenization_spaces": False}
    write_exclusive(out / "tokenizer_config.json", (json.dumps(tok_config, indent=2) + "\n").encode())
    return out

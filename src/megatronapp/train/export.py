"""Export a trained model as a Hugging Face directory (`megatronapp export CKPT --hf OUT`).

The checkpoint of any layout (tp/pp/vpp/dp, ZeRO-1) is consolidated into one model with the real vocabulary
(`train/consolidate.py`); each tensor is then renamed and laid out as transformers' GPT2LMHeadModel or
LlamaForCausalLM expects it: exactly the inverse of `model/hf.py`'s loading (Conv1D weights transposed back, the
fused group-ordered qkv split into q, k and v). The directory gets `config.json`, `model.safetensors`, and the
tokenizer as `tokenizer.json` with `tokenizer_config.json`: the run's own tokenizer.json, or for the byte
tokenizer a byte-level vocabulary of 256 tokens whose id is the byte, so ids equal the run's.

The source may also be an exported (or any local Hugging Face GPT-2/Llama) directory: it is loaded through
`model/hf.py`, so exporting an export again reproduces its tensors bit for bit.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from megatronapp.config import ConfigError, ModelConfig
from megatronapp.model.attention import split_qkv

TOKENIZER_FILE = "tokenizer.json"


class ExportError(ConfigError):
    """A checkpoint that cannot be exported as asked; the message names the setting and the way out."""


def _is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and not (path / "meta.json").is_file()


def load_weights(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], str | Path]:
    """(model config, full unpadded state dict in our names, tokenizer spec) of a trainer checkpoint (any layout;
    a step directory, `.../checkpoints/latest` or a run directory) or of a local Hugging Face directory."""
    p = Path(path)
    if _is_hf_dir(p):
        from megatronapp.model.hf import config_from_hf, load_hf_weights
        from megatronapp.model.transformer import build_model, unpadded_state_dict

        cfg = config_from_hf(p)
        model = build_model(cfg)
        load_hf_weights(model, p)
        return cfg, unpadded_state_dict(model), p if (p / TOKENIZER_FILE).is_file() else "byte"
    from megatronapp.config import RunConfig
    from megatronapp.train import checkpoint as ckpt
    from megatronapp.train.consolidate import consolidate

    d = ckpt.resolve(p)
    run = RunConfig.from_dict(ckpt.load_meta(d)["config"])
    cfg, state = consolidate(d)
    return cfg, state, run.train.tokenizer


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


def _write_tokenizer(spec: str | Path, out: Path, cfg: ModelConfig) -> None:
    if str(spec) == "byte":
        (out / TOKENIZER_FILE).write_text(byte_tokenizer_json())
    else:
        src = Path(spec)
        src = src / TOKENIZER_FILE if src.is_dir() else src
        if not src.is_file():
            raise ExportError(f"the run's tokenizer {src} is missing; it is copied into the export as "
                              f"{TOKENIZER_FILE}: restore it at that path")
        if src.resolve() != (out / TOKENIZER_FILE).resolve():
            shutil.copyfile(src, out / TOKENIZER_FILE)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len,
              "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def export_hf(src: str | Path, out: str | Path) -> Path:
    """Write the Hugging Face directory `out` for the checkpoint (or HF directory) `src`; returns `out`."""
    from safetensors.torch import save_file

    cfg, state, tokenizer = load_weights(src)
    config = hf_config(cfg)
    tensors = hf_tensors(cfg, state)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--hf {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_tokenizer(tokenizer, out, cfg)
    return out

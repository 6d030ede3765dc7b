"""Load Hugging Face GPT-2 and Llama checkpoints (config.json + safetensors) into our chunks, for any tp/pp split.

Each parameter of a chunk is rebuilt as the full tensor in our layout (GPT-2's Conv1D weights transposed,
q/k/v fused in kv-group order) and then sliced for this TP rank exactly as initialisation slices it. Only the
tensors a chunk needs are read. Problems name the file and what to do about it.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatronapp.config import ConfigError, ModelConfig
from megatronapp.model.attention import fuse_qkv
from megatronapp.model.init import full_shape
from megatronapp.parallel.tensor_parallel import shard

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


class HFCheckpointError(ConfigError):
    """A Hugging Face checkpoint that is missing, unsupported or corrupt; the message names the file."""


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise HFCheckpointError(f"{path}: not a directory; pass a local Hugging Face model directory "
                                f"(the one save_pretrained wrote)")
    file = path / "config.json"
    if not file.is_file():
        raise HFCheckpointError(f"{file}: missing; a Hugging Face model directory needs its config.json")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFCheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{file}: expected a JSON object of settings")
    return data


def _need(raw: dict[str, Any], key: str, file: Path) -> Any:
    if key not in raw:
        raise HFCheckpointError(f"{file}: field {key!r} is missing")
    return raw[key]


def _unsupported(file: Path, what: str) -> HFCheckpointError:
    return HFCheckpointError(f"{file}: {what} is not supported by megatronapp's transformer")


def config_from_hf(path: str | Path) -> ModelConfig:
    """The ModelConfig of a local Hugging Face GPT-2 or Llama directory (from its config.json)."""
    path = Path(path)
    raw = _read_config(path)
    file = path / "config.json"
    kind = raw.get("model_type")
    if kind == "gpt2":
        act = raw.get("activation_function", "gelu_new")
        if act not in _TANH_GELUS:
            raise _unsupported(file, f"activation_function={act!r} (only tanh GELU: {', '.join(_TANH_GELUS)})")
        if not raw.get("scale_attn_weights", True) or raw.get("scale_attn_by_inverse_layer_idx", False):
            raise _unsupported(file, "attention scaling other than 1/sqrt(head_dim)")
        if raw.get("add_cross_attention", False):
            raise _unsupported(file, "add_cross_attention=true")
        h = _need(raw, "n_embd", file)
        return ModelConfig(family="gpt2", vocab_size=_need(raw, "vocab_size", file), hidden_size=h,
                           num_layers=_need(raw, "n_layer", file), num_heads=_need(raw, "n_head", file),
                           ffn_hidden_size=raw.get("n_inner") or 4 * h,
                           max_seq_len=_need(raw, "n_positions", file),
                           norm_eps=raw.get("layer_norm_epsilon", 1e-5), bias=True,
                           tie_embeddings=raw.get("tie_word_embeddings", True))
    if kind == "llama":
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise _unsupported(file, f"hidden_act={act!r} (Llama's SwiGLU uses silu)")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise _unsupported(file, f"rope_type={rope_type!r} (RoPE scaling)")
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        h, heads = _need(raw, "hidden_size", file), _need(raw, "num_attention_heads", file)
        if raw.get("head_dim") not in (None, h // heads):
            raise _unsupported(file, f"head_dim={raw['head_dim']} != hidden_size/num_attention_heads")
        attn_bias, mlp_bias = raw.get("attention_bias", False), raw.get("mlp_bias", False)
        if attn_bias != mlp_bias:
            raise _unsupported(file, f"attention_bias={attn_bias} with mlp_bias={mlp_bias} (one bias setting)")
        return ModelConfig(family="llama", vocab_size=_need(raw, "vocab_size", file), hidden_size=h,
                           num_layers=_need(raw, "num_hidden_layers", file), num_heads=heads,
                           num_kv_heads=raw.get("num_key_value_heads") or heads,
                           ffn_hidden_size=_need(raw, "intermediate_size", file),
                           max_seq_len=raw.get("max_position_embeddings", 2048),
                           norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=float(theta), bias=bool(attn_bias),
                           tie_embeddings=raw.get("tie_word_embeddings", False))
    raise _unsupported(file, f"model_type={kind!r} (supported: 'gpt2', 'llama')")


class _Checkpoint:
    """The tensors of a checkpoint directory: one safetensors file or a sharded set behind an index."""

    def __init__(self, path: Path):
        self.path = path
        self._open: dict[Path, Any] = {}
        index, single = path / INDEX_FILE, path / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise HFCheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from None
            self.file_of = {k: path / f for k, f in weight_map.items()}
        elif single.is_file():
            self.file_of = dict.fromkeys(self._handle(single).keys(), single)
        elif any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise HFCheckpointError(f"{path}: only PyTorch pickle weights (*.bin) found; re-save the model with "
                                    f"save_pretrained(..., safe_serialization=True) to get {SINGLE_FILE}")
        else:
            raise HFCheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}; not a Hugging Face model directory")

    def _handle(self, file: Path) -> Any:
        from safetensors import SafetensorError, safe_open

        if file not in self._open:
            if not file.is_file():
                raise HFCheckpointError(f"{file}: missing (listed in {self.path / INDEX_FILE})")
            try:
                self._open[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise HFCheckpointError(f"{file}: corrupt or not a safetensors file ({e})") from None
        return self._open[file]

    def has(self, key: str) -> bool:
        return key in self.file_of

    def get(self, key: str) -> torch.Tensor:
        if key not in self.file_of:
            where = self.path / (INDEX_FILE if (self.path / INDEX_FILE).is_file() else SINGLE_FILE)
            raise HFCheckpointError(f"{where}: tensor {key!r} is missing")
        from safetensors import SafetensorError

        file = self.file_of[key]
        handle = self._handle(file)
        try:
            return handle.get_tensor(key).float()
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise HFCheckpointError(f"{file}: cannot read tensor {key!r} ({e})") from None


def _prefix(ckpt: _Checkpoint, probe: str, prefix: str) -> str:
    # save_pretrained of a *ForCausalLM nests the body under a prefix; a bare base model does not.
    return prefix if ckpt.has(prefix + probe) else ""


def _gpt2_source(name: str, cfg: ModelConfig, ckpt: _Checkpoint) -> torch.Tensor:
    p = _prefix(ckpt, "wte.weight", "transformer.")
    get = ckpt.get
    if name == "embedding.word.weight":
        return get(p + "wte.weight")
    if name == "embedding.position.weight":
        return get(p + "wpe.weight")
    if name == "output.weight":
        return get("lm_head.weight") if ckpt.has("lm_head.weight") else get(p + "wte.weight")
    if name.startswith("final_norm."):
        return get(p + "ln_f." + name.rsplit(".", 1)[1])
    _, i, rest = name.split(".", 2)
    base = f"{p}h.{i}."
    if rest.startswith("attn.qkv."):
        w = get(base + "attn.c_attn." + rest.rsplit(".", 1)[1])
        w = w.t() if w.dim() == 2 else w  # Conv1D stores [in, out]
        q, k, v = w.split(cfg.hidden_size, dim=0)
        return fuse_qkv(q, k, v, cfg.num_heads, cfg.num_kv_heads)
    plain = {"norm1": "ln_1", "norm2": "ln_2", "attn.proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc",
             "mlp.fc2": "mlp.c_proj"}
    module, leaf = rest.rsplit(".", 1)
    t = get(base + plain[module] + "." + leaf)
    return t.t() if leaf == "weight" and module not in ("norm1", "norm2") else t


def _llama_source(name: str, cfg: ModelConfig, ckpt: _Checkpoint) -> torch.Tensor:
    p = _prefix(ckpt, "embed_tokens.weight", "model.")
    get = ckpt.get
    if name == "embedding.word.weight":
        return get(p + "embed_tokens.weight")
    if name == "output.weight":
        return get("lm_head.weight") if ckpt.has("lm_head.weight") else get(p + "embed_tokens.weight")
    if name == "final_norm.weight":
        return get(p + "norm.weight")
    _, i, rest = name.split(".", 2)
    base = f"{p}layers.{i}."
    module, leaf = rest.rsplit(".", 1)
    if module == "attn.qkv":
        q, k, v = (get(f"{base}self_attn.{x}_proj.{leaf}") for x in "qkv")
        return fuse_qkv(q, k, v, cfg.num_heads, cfg.num_kv_heads)
    plain = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm", "attn.proj": "self_attn.o_proj",
             "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}
    return get(base + plain[module] + "." + leaf)


def _check_compatible(ours: ModelConfig, theirs: ModelConfig, file: Path) -> None:
    fields = ["family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
              "norm_eps", "bias", "tie_embeddings", "parallel_block", "sliding_window"]
    fields += ["max_seq_len"] if ours.family == "gpt2" else ["rope_theta"]
    for f in fields:
        a, b = getattr(ours, f), getattr(theirs, f)
        if a != b:
            raise HFCheckpointError(f"{file}: model.{f}={a!r} but the checkpoint has {b!r}; build the model "
                                    f"from megatronapp.model.hf.config_from_hf({str(file.parent)!r})")


def load_hf_weights(chunk: torch.nn.Module, path: str | Path) -> None:
    """Copy this chunk's layers, and this TP rank's slices, from a local Hugging Face checkpoint directory."""
    path = Path(path)
    theirs = config_from_hf(path)
    cfg = chunk.cfg
    _check_compatible(cfg, theirs, path / "config.json")
    ckpt = _Checkpoint(path)
    source: Callable[[str, ModelConfig, _Checkpoint], torch.Tensor] = (
        _gpt2_source if cfg.family == "gpt2" else _llama_source)
    with torch.no_grad():
        for name, p in chunk.named_parameters():
            full = source(name, cfg, ckpt)
            want = full_shape(p, chunk.tp_group)
            if tuple(full.shape) != want:
                raise HFCheckpointError(f"{path}: tensor for {name} has shape {tuple(full.shape)}, expected {want}")
            p.copy_(shard(full, p, chunk.tp_group).to(device=p.device, dtype=p.dtype))

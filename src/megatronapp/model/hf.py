"""Load Hugging Face GPT-2 and Llama checkpoints (config.json + safetensors) into our chunks, for any tp/pp split.

Each parameter of a chunk is rebuilt as the full tensor in our layout (GPT-2's Conv1D weights transposed,
q/k/v fused in kv-group order) and then sliced for this TP rank exactly as initialisation slices it. Only the
tensors a chunk needs are read. Problems name the file and what to do about it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatronapp.config import ConfigError, ModelConfig, validate_model
from megatronapp.files import BadFile, read_json, short
from megatronapp.model.attention import fuse_qkv
from megatronapp.model.init import full_shape
from megatronapp.parallel.tensor_parallel import shard

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
MAX_JSON_BYTES = 64 << 20  # a config.json is a few KB, an index a few MB even for thousands of tensors


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
        data = read_json(file, MAX_JSON_BYTES, "config.json")
    except BadFile as e:
        raise HFCheckpointError(str(e)) from None
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{file}: expected a JSON object of settings")
    return data


def _need(raw: dict[str, Any], key: str, file: Path) -> Any:
    if key not in raw:
        raise HFCheckpointError(f"{file}: field {key!r} is missing")
    return raw[key]


def _int(raw: dict[str, Any], key: str, file: Path, default: Any = ...) -> Any:
    """A positive integer field: required (no `default`), else `default` when absent; with a default of None,
    null is taken as absent."""
    value = _need(raw, key, file) if default is ... else raw.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HFCheckpointError(f"{file}: field {key!r} must be a positive integer, got {short(repr(value), 80)}")
    return value


def _number(raw: dict[str, Any], key: str, file: Path, default: float) -> float:
    """A positive finite number field."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise HFCheckpointError(f"{file}: field {key!r} must be a positive number, got {short(repr(value), 80)}")
    return value


def _flag(raw: dict[str, Any], key: str, file: Path, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise HFCheckpointError(f"{file}: field {key!r} must be true or false, got {short(repr(value), 80)}")
    return value


def _unsupported(file: Path, what: str) -> HFCheckpointError:
    return HFCheckpointError(f"{file}: {what} is not supported by megatronapp's transformer")


def config_from_hf(path: str | Path) -> ModelConfig:
    """The ModelConfig of a local Hugging Face GPT-2 or Llama directory (from its config.json): every field read is
    type- and range-checked and the shape validated, each problem naming the file and the field."""
    path = Path(path)
    raw = _read_config(path)
    file = path / "config.json"
    kind = raw.get("model_type")
    if kind == "gpt2":
        act = raw.get("activation_function", "gelu_new")
        if act not in _TANH_GELUS:
            raise _unsupported(file, f"activation_function={short(repr(act), 80)} (only tanh GELU: "
                                     f"{', '.join(_TANH_GELUS)})")
        if not _flag(raw, "scale_attn_weights", file, True) or \
                _flag(raw, "scale_attn_by_inverse_layer_idx", file, False):
            raise _unsupported(file, "attention scaling other than 1/sqrt(head_dim)")
        if _flag(raw, "add_cross_attention", file, False):
            raise _unsupported(file, "add_cross_attention=true")
        h = _int(raw, "n_embd", file)
        cfg = ModelConfig(family="gpt2", vocab_size=_int(raw, "vocab_size", file), hidden_size=h,
                          num_layers=_int(raw, "n_layer", file), num_heads=_int(raw, "n_head", file),
                          ffn_hidden_size=_int(raw, "n_inner", file, None) or 4 * h,
                          max_seq_len=_int(raw, "n_positions", file),
                          norm_eps=_number(raw, "layer_norm_epsilon", file, 1e-5), bias=True,
                          tie_embeddings=_flag(raw, "tie_word_embeddings", file, True))
    elif kind == "llama":
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise _unsupported(file, f"hidden_act={short(repr(act), 80)} (Llama's SwiGLU uses silu)")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise HFCheckpointError(f"{file}: field 'rope_scaling' must be an object or null, got "
                                    f"{short(repr(rope), 80)}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise _unsupported(file, f"rope_type={short(repr(rope_type), 80)} (RoPE scaling)")
        theta = _number(rope, "rope_theta", file, 10000.0) if "rope_theta" in rope else \
            _number(raw, "rope_theta", file, 10000.0)
        h, heads = _int(raw, "hidden_size", file), _int(raw, "num_attention_heads", file)
        head_dim = _int(raw, "head_dim", file, None)
        if head_dim not in (None, h // heads):
            raise _unsupported(file, f"head_dim={head_dim} != hidden_size/num_attention_heads")
        attn_bias, mlp_bias = _flag(raw, "attention_bias", file, False), _flag(raw, "mlp_bias", file, False)
        if attn_bias != mlp_bias:
            raise _unsupported(file, f"attention_bias={attn_bias} with mlp_bias={mlp_bias} (one bias setting)")
        cfg = ModelConfig(family="llama", vocab_size=_int(raw, "vocab_size", file), hidden_size=h,
                          num_layers=_int(raw, "num_hidden_layers", file), num_heads=heads,
                          num_kv_heads=_int(raw, "num_key_value_heads", file, None) or heads,
                          ffn_hidden_size=_int(raw, "intermediate_size", file),
                          max_seq_len=_int(raw, "max_position_embeddings", file, 2048),
                          norm_eps=_number(raw, "rms_norm_eps", file, 1e-6), rope_theta=float(theta),
                          bias=attn_bias, tie_embeddings=_flag(raw, "tie_word_embeddings", file, False))
    else:
        raise _unsupported(file, f"model_type={short(repr(kind), 80)} (supported: 'gpt2', 'llama')")
    try:
        validate_model(cfg)
    except ConfigError as e:
        raise HFCheckpointError(f"{file}: {e}") from None
    return cfg


class _Checkpoint:
    """The tensors of a checkpoint directory: one safetensors file or a sharded set behind an index. With
    `shapes_only`, a tensor is a meta tensor of the shape its file's header gives (nothing is read or allocated)."""

    def __init__(self, path: Path, shapes_only: bool = False):
        self.path, self.shapes_only = path, shapes_only
        self._open: dict[Path, Any] = {}
        index, single = path / INDEX_FILE, path / SINGLE_FILE
        if index.is_file():
            self.file_of = self._read_index(index)
        elif single.is_file():
            self.file_of = dict.fromkeys(self._handle(single).keys(), single)
        elif any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise HFCheckpointError(f"{path}: only PyTorch pickle weights (*.bin) found; re-save the model with "
                                    f"save_pretrained(..., safe_serialization=True) to get {SINGLE_FILE}")
        else:
            raise HFCheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}; not a Hugging Face model directory")

    def _read_index(self, index: Path) -> dict[str, Path]:
        """tensor name -> shard file, from the index; a shard is a file of this directory (a name, never a path:
        what the index names is data, so it cannot point outside)."""
        try:
            weight_map = read_json(index, MAX_JSON_BYTES, "safetensors index")["weight_map"]
        except BadFile as e:
            raise HFCheckpointError(str(e)) from None
        except (KeyError, TypeError):
            raise HFCheckpointError(f"{index}: not a safetensors index with a 'weight_map'") from None
        if not isinstance(weight_map, dict):
            raise HFCheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
        out = {}
        for key, name in weight_map.items():
            if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
                raise HFCheckpointError(f"{index}: weight_map[{short(repr(key), 80)}] = {short(repr(name), 80)} is "
                                        f"not the name of a file in this directory")
            out[key] = self.path / name
        return out

    def _handle(self, file: Path) -> Any:
        from safetensors import SafetensorError, safe_open

        if file not in self._open:
            if not file.is_file():
                raise HFCheckpointError(f"{file}: missing (listed in {self.path / INDEX_FILE})")
            try:
                self._open[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise HFCheckpointError(f"{file}: corrupt or not a safetensors file ({short(e)})") from None
        return self._open[file]

    def has(self, key: str) -> bool:
        return key in self.file_of

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape the header of `key`'s file gives it (its data is not read)."""
        from safetensors import SafetensorError

        file = self.file_of[key]
        try:
            return tuple(self._handle(file).get_slice(key).get_shape())
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise HFCheckpointError(f"{file}: cannot read tensor {key!r} ({short(e)})") from None

    def get(self, key: str) -> torch.Tensor:
        if key not in self.file_of:
            where = self.path / (INDEX_FILE if (self.path / INDEX_FILE).is_file() else SINGLE_FILE)
            raise HFCheckpointError(f"{where}: tensor {key!r} is missing")
        if self.shapes_only:
            return torch.empty(self.shape(key), device="meta")
        from safetensors import SafetensorError

        file = self.file_of[key]
        handle = self._handle(file)
        try:
            return handle.get_tensor(key).float()
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise HFCheckpointError(f"{file}: cannot read tensor {key!r} ({short(e)})") from None


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


def check_tensors(path: str | Path, cfg: ModelConfig) -> None:
    """Check the model `cfg` (from the directory's config.json) against the tensors the directory holds, from the
    safetensors headers alone, before anything is allocated: a config.json claiming 48 layers of 4096 beside a
    3 MB file is refused here, not after the model has taken 50 GB."""
    from megatronapp.model.transformer import expected_shapes

    path = Path(path)
    ckpt = _Checkpoint(path, shapes_only=True)
    held = {key: ckpt.shape(key) for key in ckpt.file_of}
    file = path / "config.json"
    try:
        want = expected_shapes(cfg, held)
    except ValueError as e:
        raise HFCheckpointError(f"{file}: {e} in {path}") from None
    source = _gpt2_source if cfg.family == "gpt2" else _llama_source
    for name, shape in want.items():
        try:
            got = tuple(source(name, cfg, ckpt).shape)
        except (RuntimeError, ValueError) as e:  # q, k, v that cannot be split or fused as config.json says
            raise HFCheckpointError(f"{path}: the tensors of {name} do not fit {file.name}'s shape "
                                    f"({short(e, 160)})") from None
        if got != shape:
            raise HFCheckpointError(f"{path}: tensor for {name} has shape {got}; {file.name} describes {shape}")


def load_hf_model(path: str | Path) -> tuple[ModelConfig, torch.nn.Module]:
    """(config, one-process model with the weights) of a local Hugging Face directory, checked before it is built."""
    from megatronapp.model.transformer import build_model

    cfg = config_from_hf(path)
    check_tensors(path, cfg)
    model = build_model(cfg)
    load_hf_weights(model, path)
    return cfg, model


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

"""The WebSocket protocol: every message from a browser is checked here before anything acts on it.

Client -> server (JSON objects, discriminated by "type"; unknown fields are refused):
  auth      {token}                          first message when the server has a token and the URL has none
  info      {}                               model description (layers, heads, capture points)
  generate  {prompts, max_new_tokens, ...}   run one generation; steps stream back as they are computed
  stop      {}                               cancel the running generation after its current step
  control   {action, every?}                 training console: pause | resume | step | every (interval)
  ping      {}
Server -> client: hello, info, start, step, pca, done, busy, train, train_state, error {code, message}, pong.

Raw text is size-checked before it is parsed, so an oversized message costs no parsing. Nothing in a message
is ever evaluated: point names, pooling kinds and perturbation kinds come from fixed menus (Literal types).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from megatronapp.scope.compress import Compression
from megatronapp.scope.perturb import Perturbation

MAX_MESSAGE_BYTES = 64 * 1024
MAX_PROMPTS = 8
MAX_PROMPT_CHARS = 1000
MAX_NEW_TOKENS = 512

# Per-layer points the page can ask for, and whole-model ones.
LAYER_POINTS = ("in", "attn.q", "attn.k", "attn.v", "attn.probs", "attn.out", "mlp.out", "out")
MODEL_POINTS = ("embed", "final_norm", "logits")


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Auth(_Msg):
    type: Literal["auth"]
    token: str = Field(max_length=256)


class Info(_Msg):
    type: Literal["info"]


class Ping(_Msg):
    type: Literal["ping"]


class Stop(_Msg):
    type: Literal["stop"]


class Control(_Msg):
    """Training console: pause after the current step, run one step, resume, or set the sampling interval."""

    type: Literal["control"]
    action: Literal["pause", "resume", "step", "every", "status"]
    every: int | None = Field(None, ge=1, le=1_000_000)


class CaptureSpec(_Msg):
    """Which states to stream per step, and how to shrink each."""

    points: list[Literal["in", "attn.q", "attn.k", "attn.v", "attn.probs", "attn.out", "mlp.out", "out",
                         "embed", "final_norm", "logits"]] = Field(default_factory=list, max_length=16)
    layers: list[Annotated[int, Field(ge=0, le=4096)]] | None = Field(None, max_length=4096)
    compression: Compression = Field(default_factory=Compression)
    per_point: dict[str, Compression] = Field(default_factory=dict, max_length=16)  # overrides by point
    logit_lens: bool = False  # top token per layer for each new position
    pca_layer: int | None = Field(None, ge=0, le=4096)  # hidden states of this layer, PCA after the run


class Generate(_Msg):
    type: Literal["generate"]
    prompts: list[Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]] = Field(
        min_length=1, max_length=MAX_PROMPTS)
    max_new_tokens: int = Field(32, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=10.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=100_000)  # 0: no top-k filter
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)  # nucleus: smallest set with this mass; 1: off
    greedy: bool = False
    seed: int = Field(0, ge=0, le=2**62)
    report_top: int = Field(5, ge=1, le=20)  # candidates reported per step
    capture: CaptureSpec = Field(default_factory=CaptureSpec)
    perturbations: list[Perturbation] = Field(default_factory=list, max_length=32)


ClientMessage = Annotated[Auth | Info | Ping | Stop | Generate | Control, Field(discriminator="type")]
_adapter: TypeAdapter = TypeAdapter(ClientMessage)
KNOWN_TYPES = ("auth", "info", "ping", "stop", "generate", "control")


class ProtocolError(Exception):
    """A message the server refuses; `code` is machine-readable, the message says what to fix."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message

    def reply(self) -> dict[str, Any]:
        return error(self.code, self.message)


def error(code: str, message: str) -> dict[str, Any]:
    """An error reply."""
    return {"type": "error", "code": code, "message": message}


def _summarise(e: ValidationError) -> str:
    # Name fields and problems, but never echo the (possibly huge or hostile) input back.
    parts = []
    for err in e.errors(include_url=False, include_input=False)[:5]:
        where = ".".join(str(x) for x in err["loc"]) or "message"
        parts.append(f"{where}: {err['msg']}")
    more = len(e.errors()) - 5
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def parse(raw: str | bytes, limit: int = MAX_MESSAGE_BYTES) -> Auth | Info | Ping | Stop | Generate | Control:
    """Check size, JSON, type and fields of one client message; raise ProtocolError with a clear reason."""
    size = len(raw.encode("utf-8") if isinstance(raw, str) else raw)
    if size > limit:
        raise ProtocolError("too_large", f"message of {size} bytes exceeds the limit of {limit} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise ProtocolError("bad_json", "message is not valid JSON") from None
    if not isinstance(data, dict):
        raise ProtocolError("bad_message", "message must be a JSON object with a 'type' field")
    kind = data.get("type")
    if kind not in KNOWN_TYPES:
        shown = kind if isinstance(kind, str) and len(kind) <= 32 else "(missing or not a short string)"
        raise ProtocolError("unknown_type", f"unknown message type {shown!r}; known: {', '.join(KNOWN_TYPES)}")
    try:
        return _adapter.validate_python(data)
    except ValidationError as e:
        raise ProtocolError("invalid", f"invalid {kind} message: {_summarise(e)}") from None

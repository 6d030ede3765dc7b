"""MegaScope during training: every N steps, show the model thinking about a fixed probe prompt.

`--scope-port` attaches `plugin` (the trainer's plug-in seam), which on rank 0 constructs `TrainingScope(port)` and
calls `on_step(step, model_chunks, metrics)` after every optimizer step and `close()` at shutdown. On a sampled
step, when rank 0 holds the whole model (tp = pp = 1), the hook runs a short greedy, KV-cached generation of the
probe prompt with capture on, outside autograd and in eval mode, and streams it to every connected page exactly like
an interactive generation: attention, Q/K/V, MLP outputs, logit lens and PCA show how the model's predictions change
as it learns. The training forward itself carries no hooks, so training numerics are untouched. With tp or pp > 1
rank 0 holds only a part of the model and cannot run it alone: the page then shows the metrics (loss, learning rate,
gradient norm) only.

The page is also a console (`control` messages, behind the same token as the page): pause after the current
step, run one step, resume, and change the sampling interval. The console always needs a token, on loopback too
(given, $MEGASCOPE_TOKEN, or a random one printed in the URL): any local user could otherwise pause the run, and
under `--supervise` a pause is later judged a hang that restarts the job. A pause blocks the trainer's step-end
hook on rank 0, so the run stops between optimizer steps with nothing half done; other ranks wait in their next
collective.
"""
from __future__ import annotations

import secrets
import threading
from typing import Any

import torch

from megatronapp.data.tokenizer import ByteTokenizer
from megatronapp.scope.generate import ScopeModel, generate
from megatronapp.scope.protocol import Generate


class TrainingScope:
    """The trainer's MegaScope observer: a read-only page fed every `every` steps."""

    def __init__(self, port: int, every: int = 50, host: str = "127.0.0.1", token: str | None = None,
                 probe: str = "After Monday comes ", probe_tokens: int = 8, tokenizer: Any = None,
                 announce: Any = print, insecure: bool = False, always: bool = False):
        from megatronapp.scope.security import Guard, check_bind, page_url, resolve_token
        from megatronapp.scope.server import ServerThread, create_app

        if every < 1:
            raise ValueError(f"TrainingScope(every={every}) must be >= 1")
        self.every, self.probe, self.probe_tokens = every, probe, probe_tokens
        self.always = always  # probe even when no page is watching (tests, benchmarks)
        self.tokenizer = tokenizer or ByteTokenizer()
        self.history: list[dict[str, float]] = []
        self.step = 0
        # console state: `paused` stops the run at the next step end; `allowed` steps may still run while paused
        self.paused, self.allowed, self.waiting = False, 0, False
        self._cond = threading.Condition()
        self._closed = False
        token = resolve_token(token, host, insecure) or secrets.token_urlsafe(24)  # on loopback too: see above
        check_bind(host, token, insecure)
        self.token = token
        self.app = create_app(None, token=token, read_only=True, guard=Guard(bind_host=host))
        self.app.state.control = self.control
        self.server = ServerThread(self.app, host, port).start()
        announce(f"MegaScope (training) at {page_url(host, self.server.port, token)}")

    @property
    def ws_url(self) -> str:
        """The console's WebSocket address, token included (tests, scripts)."""
        from urllib.parse import quote

        return f"ws://127.0.0.1:{self.server.port}/ws?token={quote(self.token, safe='')}"

    def control(self, action: str, every: int | None) -> dict[str, Any]:
        """Apply a console action (pause | resume | step | every | status); the new state, as the page sees it."""
        with self._cond:
            if action == "pause":
                self.paused, self.allowed = True, 0
            elif action == "resume":
                self.paused, self.allowed = False, 0
            elif action == "step":
                self.paused, self.allowed = True, self.allowed + 1
            elif action == "every" and every is not None:
                self.every = every
            self._cond.notify_all()
            return self._state()

    def _state(self) -> dict[str, Any]:
        return {"type": "train_state", "step": self.step, "paused": self.paused, "waiting": self.waiting,
                "every": self.every}

    def _hold(self) -> None:
        """Block the trainer while paused (after this step, before the next), unless a step was allowed."""
        from megatronapp.scope.server import publish

        if not self.paused:  # the common case costs one attribute read
            return
        with self._cond:
            if self.paused and self.allowed > 0:
                self.allowed -= 1
                return
            self.waiting = True
            publish(self.app, self._state())
            while self.paused and self.allowed == 0 and not self._closed:
                self._cond.wait(timeout=1.0)
            if self.paused and self.allowed > 0:
                self.allowed -= 1
            self.waiting = False
        publish(self.app, self._state())

    def on_step(self, step: int, model_chunks: list[torch.nn.Module], metrics: dict[str, Any]) -> None:
        """Publish this step's metrics; on every `every`-th step also a probe generation (whole model only)."""
        from megatronapp.scope.server import publish

        point = {k: float(metrics[k]) for k in ("loss", "lr", "grad_norm") if isinstance(metrics.get(k), (int, float))}
        self.step = step
        self.history.append({"step": step, **point})
        publish(self.app, {"type": "train", "step": step, **point})
        try:
            self._probe(step, model_chunks)
        finally:
            self._hold()

    def _probe(self, step: int, model_chunks: list[torch.nn.Module]) -> None:
        from megatronapp.scope.server import publish, watchers

        if step % self.every or not (self.always or watchers(self.app)):
            return  # a probe nobody sees is not run: a run with the page closed pays nothing for it
        chunk = model_chunks[0] if len(model_chunks) == 1 else None
        if chunk is None or not (chunk.pre_process and chunk.post_process) or chunk.tp_group is not None and \
                getattr(chunk.tp_group, "size", 1) > 1:
            return
        sm = ScopeModel(chunk, chunk.cfg, self.tokenizer, name=f"training step {step}")
        self.app.state.scope_model = sm
        publish(self.app, {"type": "info", "model": sm.describe()})  # the page builds its layer/head selectors
        req = Generate(type="generate", prompts=[self.probe], max_new_tokens=self.probe_tokens, greedy=True,
                       capture={"points": ["attn.q", "attn.k", "attn.v", "attn.probs", "mlp.out"], "logit_lens": True,
                                "pca_layer": chunk.cfg.num_layers - 1})
        was_training = chunk.training
        chunk.eval()
        try:
            generate(sm, req, lambda m: publish(self.app, m))
        finally:
            chunk.train(was_training)

    def close(self) -> None:
        """Stop the server (and release a paused trainer)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.server.stop()


def plugin(trainer: Any) -> None:
    """Plug-in entry for `--scope-port`: on rank 0, serve the page and feed it after every step."""
    if trainer.rank != 0:
        return
    scope = TrainingScope(trainer.cfg.scope_port)
    trainer.hooks.on("step_end", lambda step, record: scope.on_step(step, trainer.chunks, record))
    trainer.hooks.on("shutdown", scope.close)

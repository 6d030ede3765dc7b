"""The embedded default model: a tiny GPT-2 trained on the embedded corpus, shipped so the page works offline.

`python -m megatronapp.scope.default_model --train` retrains it in one process (a few minutes on 2 CPU cores)
and writes src/megatronapp/assets/scope_default.safetensors (fp16) and scope_default.json (config + training).
`load_default_model()` loads it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from megatronapp.config import ModelConfig, preset
from megatronapp.data.corpus import embedded_corpus
from megatronapp.data.tokenizer import ByteTokenizer
from megatronapp.eager_optim import AdamW
from megatronapp.model.transformer import (
    TransformerChunk,
    build_model,
    load_unpadded_state_dict,
    unpadded_state_dict,
)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
WEIGHTS = "scope_default.safetensors"
META = "scope_default.json"


@dataclasses.dataclass
class Recipe:
    """How the shipped checkpoint was trained."""

    preset: str = "gpt2-tiny"
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 30
    weight_decay: float = 0.01
    seed: int = 1234
    threads: int = 2


def _lr(step: int, r: Recipe) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    frac = (step - r.warmup) / max(1, r.steps - r.warmup)
    return r.min_lr + 0.5 * (r.lr - r.min_lr) * (1 + math.cos(math.pi * frac))


def train(recipe: Recipe, out_dir: Path = ASSETS, log_every: int = 50) -> dict:
    """Train the default model with plain AdamW in this process and write its checkpoint; returns the metadata."""
    from safetensors.torch import save_file

    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    cfg = preset(recipe.preset)
    model = build_model(cfg, seed=recipe.seed)
    data = ByteTokenizer().encode_tensor(embedded_corpus())
    split = int(len(data) * 0.95)
    train_ids, val_ids = data[:split], data[split:]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                 {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(recipe.seed)

    def batch(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(ids) - recipe.seq_len - 1, (recipe.batch_size,), generator=gen)
        rows = torch.stack([ids[s:s + recipe.seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    t0, loss = time.time(), torch.tensor(0.0)
    model.train()
    for step in range(recipe.steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, recipe)
        x, y = batch(train_ids)
        loss = model(x, labels=y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or step == recipe.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  {time.time() - t0:.0f}s", flush=True)
    model.eval()
    with torch.no_grad():
        # mean over a few random validation windows (the last 5% of the corpus, never trained on)
        val = sum(model(xs, labels=ys).item() for xs, ys in (batch(val_ids) for _ in range(4))) / 4
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.half().contiguous() for k, v in unpadded_state_dict(model).items()}
    save_file(state, str(out_dir / WEIGHTS))
    meta = {"model": dataclasses.asdict(cfg), "tokenizer": "byte", "training": dataclasses.asdict(recipe),
            "final_train_loss": round(loss.item(), 4), "val_loss": round(val, 4),
            "train_seconds": round(time.time() - t0, 1), "dtype": "fp16",
            "corpus": "megatronapp.data.corpus.embedded_corpus()"}
    (out_dir / META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_default_model(assets: Path = ASSETS) -> tuple[TransformerChunk, ModelConfig, dict]:
    """The shipped default model in fp32 eval mode, its config and its training metadata."""
    from safetensors.torch import load_file

    wpath, mpath = assets / WEIGHTS, assets / META
    if not wpath.is_file() or not mpath.is_file():
        raise FileNotFoundError(f"default model files {wpath} / {mpath} are missing; recreate them with "
                                f"`python -m megatronapp.scope.default_model --train`")
    meta = json.loads(mpath.read_text())
    cfg = ModelConfig(**meta["model"])
    model = build_model(cfg)
    state = {k: v.float() for k, v in load_file(str(wpath)).items()}
    load_unpadded_state_dict(model, state)
    model.eval()
    return model, cfg, meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="train or inspect MegaScope's embedded default model")
    ap.add_argument("--train", action="store_true", help="retrain and overwrite the shipped checkpoint")
    ap.add_argument("--steps", type=int, default=Recipe.steps)
    ap.add_argument("--out", type=Path, default=ASSETS)
    args = ap.parse_args(argv)
    if args.train:
        meta = train(Recipe(steps=args.steps), args.out)
        print(json.dumps({k: meta[k] for k in ("final_train_loss", "val_loss", "train_seconds")}))
        return 0
    _, _cfg, meta = load_default_model(args.out)
    print(json.dumps(meta, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Checks of a run recovered in place (`train --supervise --spares K`) against an uninterrupted one, shared by the
in-place recovery tests: the supervisor's events, the healthy ranks' processes, and bit-identity of every step's
loss, the final weights and the optimizer state (plain or ZeRO-1 slices).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from megatronapp.train import checkpoint as ckpt
from megatronapp.train.metrics import read_metrics


def events(out: Path) -> list[dict]:
    """The supervisor's events so far ([] before its first)."""
    path = out / "resilience.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


FORMATION_FAILURE = "did not commit a step within"


def caused(summary: dict) -> tuple[list[dict], list[int]]:
    """The failures a test caused and the ranks replaced for them, without the supervisor's formation failures.
    Rarely (docs/resilience.md, Limits: a gloo send stranded until the operation timeout, now only a large one
    part-written when its peer leaves) a healthy survivor never begins the next generation and the supervisor names
    it after `form_timeout_s`: it is replaced like any failure and the run
    stays bit-identical, so a test of something else leaves it out of its exact lists (and prints it)."""
    formation = [f for f in summary["failures"] if FORMATION_FAILURE in f["message"]]
    if formation:
        print(f"formation failures (a healthy rank replaced): {[(f['rank'], f['message']) for f in formation]}")
    replaced = [r["rank"] for r in summary["replacements"]]
    for f in formation:
        replaced.remove(f["rank"])
    return [f for f in summary["failures"] if f not in formation], replaced


def assert_bit_identical(out: Path, baseline: Path, steps: int, world: int, replayed: tuple[int, ...] = ()) -> None:
    """Every step logged once with the baseline's loss (none replayed but `replayed`, the steps a rollback to a
    checkpoint computed again, with the same losses), and every rank's final weights and optimizer state equal."""
    ref = {r["step"]: r["loss"] for r in read_metrics(baseline / "metrics.jsonl")}
    records = read_metrics(out / "metrics.jsonl")
    again = [r for r in records if r.get("replayed")]
    assert sorted(r["step"] for r in again) == sorted(replayed), "steps computed again"
    records = [r for r in records if not r.get("replayed")]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), "a step was computed twice or lost"
    assert {r["step"]: r["loss"] for r in records} == ref
    assert all(r["loss"] == ref[r["step"]] for r in again)
    d, d_ref = ckpt.step_dir(out / "checkpoints", steps), ckpt.step_dir(baseline / "checkpoints", steps)
    for rank in range(world):
        mine, theirs = ckpt.load_rank(d, rank), ckpt.load_rank(d_ref, rank)
        for c_mine, c_ref in zip(mine["chunks"], theirs["chunks"]):
            assert c_mine.keys() == c_ref.keys()
            for name in c_ref:
                assert torch.equal(c_mine[name], c_ref[name]), f"rank {rank}: {name}"
        o_mine, o_ref = mine["optimizer"], theirs["optimizer"]
        if "inner" in o_ref:  # ZeRO-1: this rank's slice, with its slicing
            assert {k: v for k, v in o_mine.items() if k != "inner"} == {k: v for k, v in o_ref.items() if k != "inner"}
            o_mine, o_ref = o_mine["inner"], o_ref["inner"]
        s_mine, s_ref = o_mine["state"], o_ref["state"]
        assert s_mine.keys() == s_ref.keys()
        for i in s_ref:
            for k in s_ref[i]:
                assert torch.equal(s_mine[i][k], s_ref[i][k]), f"rank {rank}: optimizer state {i}.{k}"


def assert_healthy_ranks_kept(out: Path) -> list[dict]:
    """Across every generation, a rank's process changed only where it was replaced; returns the generations."""
    gens = [e for e in events(out) if e["event"] == "generation"]
    assert gens[0]["generation"] == 0
    for before, now in zip(gens, gens[1:]):
        for r, pid in now["pids"].items():
            if r in now["replaced"]:
                assert now["replaced"][r]["old_pid"] == before["pids"][r] and pid != before["pids"][r]
            else:
                assert pid == before["pids"][r], f"rank {r} was restarted in generation {now['generation']}"
    return gens

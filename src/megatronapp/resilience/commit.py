"""A step is a transaction: the optimizer update runs only once every rank finished the step's work before it.

Commit point. Right before its update (every collective of the step has completed on this rank: gradient
reduction, clipping norm, the loss) a rank votes in the supervisor's store: `add(votes/<g>/<k>, 1)`. The rank
whose vote makes the count equal to the world size sets the outcome "commit" with `compare_set(outcome, "",
...)`; every rank then reads the outcome (a store `get` waits until it exists) and updates only on "commit".

Abort. When the supervisor ends the generation (a rank died, or was killed because it hung) it first decides
every undecided commit as "abort", with the same `compare_set`: whichever of the last voter and the supervisor
comes first decides, and everybody reads that one value. So

  * every vote in: "commit" (even if the last voter dies right after voting): every live rank applies the
    update; a newcomer taking the place of a rank that died after its vote receives the updated state from a peer
    (the step is rolled forward);
  * a vote missing: "abort": nobody applied the step, every rank's state is the previous step's, and the step is
    simply run again in the next generation.

Only one commit of a generation is ever undecided (the k-th needs every rank, which needs the (k-1)-th
decided), so the supervisor walks from the last known commit (`committed/<g>`) to the first undecided one. A rank
whose own store connection was shut while it waited (the generation ended) reads the outcome over its control
connection: the supervisor decided it before ending the generation.
"""
from __future__ import annotations

import time
from typing import Any

from megatronapp.resilience import generation_protocol as gp


class StepAborted(RuntimeError):
    """The step's commit was decided "abort": nobody applies its update."""


class StepCommit:
    """A rank's commit point in generation `generation` (a `Trainer.commit`): the k-th call votes on commit k."""

    def __init__(self, store: Any, control: Any, generation: int, world: int):
        self.store, self.control = store, control  # the generation's own connection; the long-lived one
        self.g, self.world = generation, world
        self.k = 0  # commits of this generation so far

    def __call__(self, step: int) -> None:
        """Vote for step `step` and return once it is committed; raise StepAborted when it is not."""
        key = gp.outcome_key(self.g, self.k)
        try:
            if self.store.add(gp.votes_key(self.g, self.k), 1) == self.world:
                if self.store.compare_set(key, "", f"commit {step}").startswith(b"commit"):
                    self.store.set(gp.committed_key(self.g), str(self.k))
                    if self.k == 0:  # the generation's first committed step: the end of a recovery
                        self.store.set(gp.first_commit_key(self.g), repr(time.time()))
            outcome = self.store.get(key)
        except Exception:  # the generation ended while this rank waited: its connection was shut down
            if not self.control.check([key]):
                raise
            outcome = self.control.get(key)
        if not outcome.startswith(b"commit"):
            raise StepAborted(f"step {step + 1} was not committed (generation {self.g} ended before every rank "
                              f"finished it): nobody applied it")
        self.k += 1


def abort_undecided(store: Any, generation: int) -> int:
    """The supervisor, ending `generation`: decide its undecided commit as "abort". Returns how many commits of
    the generation were decided "commit" (the index of the aborted one)."""
    hint = gp.committed_key(generation)
    k = gp.number(store.get(hint), hint, int) + 1 if store.check([hint]) else 0
    while store.compare_set(gp.outcome_key(generation, k), "", "abort").startswith(b"commit"):
        k += 1
    return k

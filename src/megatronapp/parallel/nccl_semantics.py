"""`--comm-semantics nccl`: make gloo obey NCCL's rules, so a CPU test fails where a GPU job would hang.

Our users run NCCL; CI runs gloo, which is more forgiving. Three NCCL rules are enforced here:

1. **Tags are ignored**: point-to-point operations between two ranks match in issue order. Every P2P op is
   issued with one tag, so gloo matches them by order too (pytorch/pytorch#94819).
2. **One stream per pair**: the P2P ops of one process group between two ranks run in issue order on one
   stream, whatever their direction, so a receive posted before a send to the same peer blocks that send until
   it completes (NVIDIA/nccl#479). Each op here waits for the previous op of its (group, peer) stream before it
   is issued; ops submitted together (`batch_isend_irecv`, NCCL's group calls) are issued together. An op held
   back longer than `stall_timeout_s` is reported as the deadlock it would be on GPUs, naming both ops.
3. **Collectives in the same order on every member**: before each collective every member publishes the op's
   signature (name, bytes, label) under its per-group sequence number in the job's key-value store and reads
   the others'. A different op at the same position, or a member that never arrives, raises
   `CollectiveOrderError` naming the group, the position and what each member issued, instead of hanging or
   silently reducing the wrong tensors together.

Those three always hold (`--comm-semantics nccl`). Which communicator carries an op depends on how the job
started, and each regime adds a rule of its own; the engine must pass both:

4. `nccl-lazy` (no `device_id` in `init_process_group`, torch's default): the first send/recv of each (group,
   pair) creates a 2-rank communicator, and creation blocks the host until the peer's first op on the same
   (group, pair) (pytorch/pytorch#136248, #129140). The first collective or grouped call on a group creates the
   group's communicator: all members meet. Modelled as a blocking rendezvous in the job's store.
5. `nccl-eager` (`device_id` given, as torchtitan does): every op of a group, P2P and collectives, runs on the
   group's one communicator and stream in issue order (pytorch PR #154132, issue #152220): a rank that receives
   from one peer and then sends to another on one group cannot send before that receive completes.

Everything here runs only in the strict mode; the native path pays nothing.
"""
from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist


class StreamStall(RuntimeError):
    """A P2P op that NCCL would never run: it waits behind another op of the same stream."""


class CollectiveOrderError(RuntimeError):
    """Members of a group issued different collectives at the same position (or one never arrived)."""


class Strict:
    """State of the strict mode in one process: the per-stream tails and the first error seen."""

    def __init__(self, stall_timeout_s: float = 120.0, epoch: int = 0, mode: str = "nccl"):
        self.stall_timeout_s = stall_timeout_s
        self.lazy, self.eager = mode == "nccl-lazy", mode == "nccl-eager"
        self._created: set[tuple] = set()  # lazy: communicators this rank has created (group, ranks, pair)
        self.epoch = epoch  # distinguishes runs in one process (keys in the shared store)
        # per stream: the last op's completion event, description, direction, error (a one-item box) and peers
        self._tails: dict[tuple[str, int | None], tuple[threading.Event, str, str, list, frozenset]] = {}
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    # -- rule 2 (and 5): streams ---------------------------------------------------------------------------
    def submit(self, streams: Sequence[tuple[str, int | None]], direction: str, describe: str,
               issue: Callable[[], list[Any]], done: Callable[[BaseException | None], None]) -> None:
        """Issue `issue()` once the previous op on each of `streams` (group name, peer; peer None: the whole
        group) has completed; then wait for it and call `done`. `direction` is "send", "recv", "group" (ops
        submitted together) or "collective". Under nccl-eager every stream of a group is the group's one."""
        peers = frozenset(p for _, p in streams)  # whom this op talks to, before eager folds the streams
        if self.eager:
            streams = sorted({(g, None) for g, _ in streams}, key=str)
        me, my_error = threading.Event(), []
        with self._lock:
            prevs = [self._tails.get(s) for s in streams]
            for s in streams:
                self._tails[s] = (me, describe, direction, my_error, peers)

        def run() -> None:
            err: BaseException | None = None
            try:
                for s, prev in zip(streams, prevs):
                    if prev is None:
                        continue
                    same_peer = None not in peers and peers == prev[4]
                    if prev[2] == direction != "group" and (direction == "collective" or same_peer):
                        # behind an op of the same direction and peer (on the pair's stream, or on the group's one
                        # under nccl-eager): plain order, not a deadlock, however long the one ahead takes
                        prev[0].wait()
                    elif not prev[0].wait(self.stall_timeout_s):
                        raise StreamStall(self._stall_text(describe, prev[1], s))
                    if prev[3]:  # on NCCL a failed op poisons its stream: nothing behind it runs
                        raise RuntimeError(f"{describe} was not issued: {prev[1]} failed before it on the stream of "
                                           f"(group {s[0]}, peer {s[1]}): {prev[3][0]}")
                for work in issue():
                    work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the op
                err = e
                my_error.append(e)
                with self._lock:
                    if self.error is None:
                        self.error = e
            me.set()
            done(err)

        threading.Thread(target=run, name=f"nccl-stream {describe}", daemon=True).start()

    def _stall_text(self, describe: str, ahead: str, stream: tuple[str, int | None]) -> str:
        if stream[1] is None:
            return (f"{describe} waited {self.stall_timeout_s:.0f} s behind {ahead} on the NCCL stream of group "
                    f"{stream[0]} (nccl-eager: one communicator and stream per group, P2P and collectives in issue "
                    f"order), so this op can only start after that one completes. Give each (pair, direction) a "
                    f"group of its own, or group the ops (batch_isend_irecv)")
        return (f"{describe} waited {self.stall_timeout_s:.0f} s behind {ahead} on the NCCL stream of "
                f"(group {stream[0]}, peer {stream[1]}): NCCL runs one pair's ops in issue order, so this op can "
                f"only start after that one completes. Post them in the same order on both ranks, "
                f"or group them (batch_isend_irecv)")

    def gate(self, group_name: str, describe: str) -> None:
        """nccl-eager, before a blocking collective: the group's stream must have drained (timed)."""
        if not self.eager:
            return
        with self._lock:
            prev = self._tails.get((group_name, None))
        if prev is not None and not prev[0].wait(self.stall_timeout_s):
            raise self._fail(StreamStall(self._stall_text(describe, prev[1], (group_name, None))))

    # -- rule 4: lazy communicator creation --------------------------------------------------------------
    def first_use(self, group_name: str, group_ranks: tuple[int, ...], peer: int | None, describe: str) -> None:
        """nccl-lazy: block like NCCL's communicator creation on this rank's first op of (group, pair) (peer
        None: the group's collective communicator, all members) until the other members make theirs."""
        if not self.lazy:
            return
        me = dist.get_rank()
        members = tuple(group_ranks) if peer is None else tuple(sorted((me, peer)))
        key = (group_name, group_ranks, members)
        if key in self._created:
            return
        self._created.add(key)
        store = dist.distributed_c10d._get_default_store()
        what = "group" if peer is None else "2-rank"
        pair = ",".join(map(str, group_ranks)) if peer is None else f"{members[0]}:{members[1]}"
        base = f"mapp/strict/{self.epoch}/lazy/{group_name}/{','.join(map(str, group_ranks))}/{pair}"
        blocked = f"mapp/strict/{self.epoch}/blocked/{me}"
        store.set(f"{base}/{me}", describe)
        store.set(blocked, f"{describe} (creating the {what} NCCL comm of (group {group_name}, pair {pair}))")
        others = [r for r in members if r != me]
        keys = [f"{base}/{r}" for r in others]
        try:
            store.wait(keys, datetime.timedelta(seconds=self.stall_timeout_s))
        except Exception as e:  # the store's timeout: name what the missing members are blocked in, if anything
            missing = [r for r, k in zip(others, keys) if not store.check([k])]
            theirs = "; ".join(f"rank {r} is itself blocked in {b}" if (b := self._blocked_in(store, r))
                               else f"rank {r} never made that call" for r in missing)
            raise self._fail(StreamStall(
                f"rank {me} blocked {self.stall_timeout_s:.0f} s creating the {what} NCCL comm of (group "
                f"{group_name}, pair {pair}) for {describe}: without device_id, NCCL creates it on the first op and "
                f"waits for the peer's first op on the same (group, pair); {theirs}. Make first uses in one "
                f"order on every rank (create and warm up communicators at start-up)")) from e
        store.set(blocked, "")  # no longer blocked: a later report must not name this op

    def _blocked_in(self, store: Any, rank: int) -> str:
        key = f"mapp/strict/{self.epoch}/blocked/{rank}"
        return store.get(key).decode() if store.check([key]) else ""

    # -- rule 3: collective order ------------------------------------------------------------------------
    def check_collective(self, group_name: str, group_ranks: tuple[int, ...], seq: int, signature: str) -> None:
        """Compare this op with every member's op at the same position of the group's sequence."""
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
        base = f"mapp/strict/{self.epoch}/{group_name}/{','.join(map(str, group_ranks))}/{seq}"
        store.set(f"{base}/{me}", signature)
        others = [r for r in group_ranks if r != me]
        keys = [f"{base}/{r}" for r in others]
        try:
            store.wait(keys, datetime.timedelta(seconds=self.stall_timeout_s))
        except Exception as e:  # the store's timeout: name who never arrived
            missing = [r for r, k in zip(others, keys) if not store.check([k])]
            raise self._fail(CollectiveOrderError(
                f"collective #{seq} on group {group_name} {list(group_ranks)}: rank(s) {missing} did not issue "
                f"it within {self.stall_timeout_s:.0f} s while rank {me} issued {signature}. Every member must issue "
                f"the group's collectives in the same order")) from e
        theirs = {r: store.get(k).decode() for r, k in zip(others, keys)}
        if any(s != signature for s in theirs.values()):
            issued = "; ".join(f"rank {r}: {s}" for r, s in sorted({**theirs, me: signature}.items()))
            raise self._fail(CollectiveOrderError(
                f"collective order differs on group {group_name} {list(group_ranks)} at op #{seq}: {issued}. "
                f"On NCCL this hangs, or reduces different tensors together when their sizes match"))

    def _fail(self, e: BaseException) -> BaseException:
        with self._lock:
            if self.error is None:
                self.error = e
        return e

"""Helper threads work on the rank's GPU, never on GPU 0 (issue 39, item 5).

A new thread's current CUDA device is 0. The checkpoint writer thread leaving `torch.cuda.stream(...)` would make
device 0 current (`cudaSetDevice(0)`: a ~0.5 GB CUDA context on GPU 0 from every rank of a node), and a MegaScan
span closed on a helper thread would record its event on device 0 (then `elapsed_time` against the rank's events
raises). These tests stand in for torch.cuda with fakes that keep a current device per thread, as CUDA does.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager

import pytest
import torch

from megatronapp.scan.record.tracer import Tracer, base_header
from megatronapp.train import async_checkpoint

RANK_GPU = 3


class _FakeCuda:
    """torch.cuda's device, stream and event calls, with CUDA's per-thread current device (0 on a new thread)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.current: dict[int, int] = {threading.get_ident(): RANK_GPU}  # the training thread set its device
        self.calls: list[tuple[str, str]] = []  # (thread name, what)
        fake = self

        class Stream:
            def __init__(self, device=None):
                self.device = fake._index(device)

            def wait_stream(self, other):
                pass

            def synchronize(self):
                fake._note("synchronize")

        class Event:
            def __init__(self, enable_timing=False):
                self.device = None

            def record(self, stream=None):
                self.device = stream.device if stream is not None else fake._cur()
                fake._note(f"event on {self.device}")

            def query(self):
                return True

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                if other.device != self.device:
                    raise RuntimeError("elapsed_time across devices")
                return 1.0

        @contextmanager
        def stream(s):
            fake._note("enter stream")
            yield
            fake._note(f"leave stream: current device {fake._cur()}")

        def set_device(d):
            fake.current[threading.get_ident()] = fake._index(d)
            fake._note(f"set_device {fake._index(d)}")

        self.Stream, self.Event = Stream, Event
        for name, value in {"Stream": Stream, "Event": Event, "stream": stream, "set_device": set_device,
                            "current_stream": lambda device=None: Stream(device),
                            "current_device": lambda: self._cur(), "synchronize": lambda *a: None}.items():
            monkeypatch.setattr(torch.cuda, name, value)

    def _cur(self) -> int:
        return self.current.get(threading.get_ident(), 0)

    def _index(self, d) -> int:
        if d is None:
            return self._cur()
        return d.index if isinstance(d, torch.device) else int(d)

    def _note(self, what: str) -> None:
        self.calls.append((threading.current_thread().name, what))

    def on(self, thread: str) -> list[str]:
        return [w for t, w in self.calls if t == thread]


def test_the_checkpoint_writer_thread_sets_the_state_device_first(monkeypatch, tmp_path):
    cuda = _FakeCuda(monkeypatch)
    monkeypatch.setattr(async_checkpoint, "_device_of", lambda copies: torch.device("cuda", RANK_GPU))
    saver = async_checkpoint.AsyncSaver(tmp_path, rank=0, world=1)
    saver.save(1, {"w": torch.ones(4)}, {"step": 1})
    saver.wait()
    writer = cuda.on("ckpt-1")
    assert writer, cuda.calls
    assert writer[0] == f"set_device {RANK_GPU}", writer  # before any stream or synchronisation
    assert all(not w.startswith("leave stream") or w.endswith(str(RANK_GPU)) for t, w in cuda.calls), cuda.calls


def test_spans_closed_on_a_helper_thread_are_timed_on_the_rank_gpu(monkeypatch, tmp_path):
    cuda = _FakeCuda(monkeypatch)
    tr = Tracer(tmp_path / "rank0.mscan", base_header(0, 1, (0, 0, 0), (1, 1, 1)), cuda=True, flush_s=3600)
    tr.step(0, begin=True)
    token = tr.open("broadcast", "comm", {})
    helper = threading.Thread(target=tr.close, args=(token,), name="comm-watcher")
    helper.start()
    helper.join()
    tr.step(0, begin=False)
    tr.close()  # resolves every span: elapsed_time between the anchor and each event must not raise
    assert cuda.on("comm-watcher") == [f"event on {RANK_GPU}"]
    assert all(w == f"event on {RANK_GPU}" for t, w in cuda.calls if w.startswith("event")), cuda.calls


def test_snapshots_pin_host_memory_only_within_a_budget(monkeypatch):
    """Every rank keeps its snapshot buffers for reuse; pinning whole states would lock most of a node's memory
    (issue 39, item 8). New buffers of GPU tensors are pinned while the budget lasts, the rest is pageable."""
    pinned: list[int] = []
    monkeypatch.setattr(async_checkpoint, "_on_gpu", lambda x: True)
    monkeypatch.setattr(async_checkpoint, "_host_empty",
                        lambda x, pin: (pinned.append(x.numel()) if pin else None) or torch.empty(x.shape))
    state = {"model": [torch.ones(256) for _ in range(3)], "optimizer": {"step": 3, "m": torch.ones(256)}}
    snap, copies = async_checkpoint.snapshot_plan(state, pin_bytes=2 * 256 * 4 + 100)
    assert pinned == [256, 256] and len(copies) == 4  # two fit the budget; all four are copied
    assert snap["optimizer"]["step"] == 3
    pinned.clear()
    async_checkpoint.snapshot_plan(state, reuse=snap, pin_bytes=0)
    assert pinned == []  # the next save reuses the buffers it has
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < async_checkpoint.pin_budget() <= host // 32

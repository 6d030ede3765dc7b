"""Launcher hardening: a rank killed by a signal is named with it, a long error cannot hang the launcher, a local
job listens on loopback only, and YAML values of the wrong type are ConfigErrors naming the field."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from megatronapp import launch
from megatronapp.config import ConfigError, RunConfig, load_yaml
from megatronapp.launch import RankFailed, spawn


def _listening_addresses() -> list[str]:
    """Local addresses of this process's listening TCP sockets (hex, as /proc/net/tcp* writes them)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if Path(table).exists():
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    out.append(cols[1].split(":")[0])
    return out


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def _report_then_die(rank: int, world: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))  # the store and gloo's pairs are up by now
    Path(out, f"rank{rank}.txt").write_text(" ".join(_listening_addresses()))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 waits for the dead rank; the launcher must stop it and still blame rank 1


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs Linux /proc")
def test_rank_killed_by_signal_is_named_and_local_jobs_listen_on_loopback_only(tmp_path):
    with pytest.raises(RankFailed, match="rank 1 failed: killed by signal SIGKILL") as info:
        spawn(_report_then_die, 2, str(tmp_path))
    assert info.value.signum == signal.SIGKILL
    for rank in range(2):
        addrs = Path(tmp_path, f"rank{rank}.txt").read_text().split()
        assert set(addrs) <= LOOPBACK, f"rank {rank} listens on {addrs}"


def _busy_in_torch(rank: int, world: int, out: str) -> None:
    import time

    import torch

    def matmuls() -> None:  # always inside torch's C++ with the GIL released, like a comm watcher in wait()
        a = torch.randn(1200, 1200)
        while True:
            a = (a @ a).clamp(-1, 1)

    threading.Thread(target=matmuls, daemon=True).start()

    def writer() -> None:  # a non-daemon thread still finishes its work before the rank ends
        time.sleep(0.5)
        Path(out, f"rank{rank}.done").write_text("written")

    threading.Thread(target=writer).start()
    time.sleep(0.2)


def test_a_finished_rank_with_a_daemon_thread_in_torch_exits_cleanly(tmp_path):
    # CI saw MegaScope ranks killed by SIGABRT ('terminate called without an active exception') after their
    # work was done: Python's finalization ends such a thread with pthread_exit, which C++ cannot unwind.
    for _ in range(2):
        spawn(_busy_in_torch, 2, str(tmp_path))
    assert all(Path(tmp_path, f"rank{r}.done").read_text() == "written" for r in range(2))


def _env_and_modules(rank: int, world: int, out: str) -> None:
    import sys

    Path(out, f"rank{rank}").write_text(f"{os.environ.get('MEGATRONAPP_PROBE', '-')} {os.environ.get('RANK')} "
                                        f"{'megatronapp.train.trainer' in sys.modules} {os.getpid()}")


def test_forked_ranks_see_the_launchers_environment_of_the_moment_and_start_with_torch_loaded(tmp_path,
                                                                                                monkeypatch):
    """Gloo ranks come from a fork server that imported torch and the engine once; each job's ranks still get
    the launching process's environment as it is when the job starts, not the server's (started earlier)."""
    monkeypatch.delenv("MEGATRONAPP_START_METHOD", raising=False)
    assert launch.start_method("gloo") == "forkserver" and launch.start_method("nccl") == "spawn"
    assert launch.start_method("gloo", prelude="m:f") == "spawn"
    monkeypatch.setenv("MEGATRONAPP_PROBE", "first")
    (tmp_path / "a").mkdir()
    spawn(_env_and_modules, 2, str(tmp_path / "a"))
    monkeypatch.setenv("MEGATRONAPP_PROBE", "second")  # the fork server is running by now
    (tmp_path / "b").mkdir()
    spawn(_env_and_modules, 2, str(tmp_path / "b"))
    for job, want in (("a", "first"), ("b", "second")):
        seen = [Path(tmp_path, job, f"rank{r}").read_text().split() for r in range(2)]
        assert [s[:3] for s in seen] == [[want, "0", "True"], [want, "1", "True"]]
    monkeypatch.setenv("MEGATRONAPP_START_METHOD", "fork")
    with pytest.raises(ValueError, match="MEGATRONAPP_START_METHOD='fork'"):
        launch.start_method("gloo")


def _say(rank: int, world: int, word: str) -> None:
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    for fd, stream in ((1, "out"), (2, "err")):  # one write each: print may write the text and the newline apart
        os.write(fd, f"{word} {stream} {rank}\n".encode())


def test_forked_ranks_write_to_the_launchers_output_of_the_moment(tmp_path, monkeypatch):
    """A launcher that redirects its stdout and stderr after the fork server started (a log file per attempt,
    a notebook, pytest's capture) gets its ranks' output where its own goes now, not where it went then."""
    monkeypatch.delenv("MEGATRONAPP_START_METHOD", raising=False)
    spawn(_say, 1, "before")  # the fork server is running from here on (it may have been before)
    saved = os.dup(1), os.dup(2)
    try:
        with open(tmp_path / "out", "a") as out, open(tmp_path / "err", "a") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            spawn(_say, 2, "after")
    finally:
        for fd, target in zip(saved, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)
    assert sorted((tmp_path / "out").read_text().split("\n")[:-1]) == ["after out 0", "after out 1"]
    assert sorted(line for line in (tmp_path / "err").read_text().splitlines() if line.startswith("after")) == [
        "after err 0", "after err 1"]


def _long_error(rank: int, world: int) -> None:
    raise ValueError("x" * 1_000_000)


def test_long_error_does_not_hang_the_launcher():
    # The old launcher sent errors through a pipe and joined the ranks first: a message longer than the pipe
    # buffer blocked the rank in its write, and the launcher forever. A thread lets a hang fail the test.
    caught: list[BaseException] = []

    def run() -> None:
        try:
            spawn(_long_error, 2)
        except BaseException as e:  # noqa: BLE001 - the result under test
            caught.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(180)
    assert not t.is_alive(), "the launcher hung on a long error"
    assert isinstance(caught[0], RankFailed) and len(str(caught[0])) > 1_000_000


@pytest.mark.parametrize("section,field,value,expect", [
    ("parallel", "tp", "'2'", "parallel.tp must be an integer, got '2'"),
    ("train", "lr", "3e-4", "train.lr must be a number, got '3e-4'.*write 3.0e-4"),
    ("train", "steps", "yes", "train.steps must be an integer, got True"),
    ("model", "num_kv_heads", "[2]", "model.num_kv_heads must be an integer or null"),
    ("train", "resume", "5", "train.resume must be a string or null"),
])
def test_yaml_value_of_the_wrong_type_names_the_field(tmp_path, section, field, value, expect):
    path = tmp_path / "cfg.yaml"
    path.write_text(f"{section}:\n  {field}: {value}\n")
    with pytest.raises(ConfigError, match=expect):
        load_yaml(path)


def test_yaml_values_of_the_right_type_load(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("parallel: {tp: 2, microbatches: 2}\ntrain: {lr: 1, min_lr: 3.0e-4, resume: null}\n"
                    "model: {num_kv_heads: null}\ninject: ['hang=0:3']\n")
    cfg = load_yaml(path)
    assert cfg.parallel.tp == 2 and cfg.train.lr == 1 and cfg.inject == ["hang=0:3"]
    with pytest.raises(ConfigError, match="inject must be a list"):
        RunConfig.from_dict({"inject": "hang=0:3"})

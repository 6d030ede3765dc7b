"""Sizes are checked before memory is spent: a tiny trace file claiming a group of 1e11 ranks or a world of 1e10
is refused at once with a clear error; bad JSON in a trace header is a clear error; a YAML alias bomb is
refused quickly with a short message; invalid UTF-8 in a .jsonl data file names the file and the line."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from megatronapp.config import ConfigError, load_yaml
from megatronapp.scan.read import format as fmt

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _block(tag: bytes, payload: bytes) -> bytes:
    return fmt._BLOCK.pack(tag, len(payload), zlib.crc32(payload)) + payload


def _trace(path: Path, header: bytes, groups: bytes | None = None) -> Path:
    data = fmt.MAGIC + _block(b"HEAD", header)
    if groups is not None:
        data += _block(b"GRPS", groups)
    path.write_bytes(data)
    return path


HEAD = json.dumps({"rank": 0, "world": 2, "coord": [0, 0, 0], "topo": [1, 1, 2]}).encode()


def test_tiny_trace_files_claiming_huge_sizes_are_refused_quickly_with_bounded_memory(tmp_path):
    d = tmp_path / "trace"
    d.mkdir()
    _trace(d / "rank00000.mst", HEAD, json.dumps([["dp", {"range": [0, 1e11, 1]}]]).encode())
    _trace(d / "rank00001.mst", json.dumps({"rank": 1, "world": 1e10, "coord": [0], "topo": [1]}).encode())
    assert (d / "rank00000.mst").stat().st_size < 200
    # in a child limited to 2 GiB of address space: an unbounded allocation fails there, not on this machine
    code = ("import resource, sys, time; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
            "from megatronapp.scan.read.format import read_dir; t = time.monotonic(); "
            f"traces, problems = read_dir({str(d)!r}); print(time.monotonic() - t); print(problems)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-1500:]
    took, problems = r.stdout.splitlines()[:2]
    assert float(took) < 5.0
    assert "rank00000.mst" in problems and "rank00001.mst" in problems and "world" in problems


def test_bad_json_in_a_trace_header_is_a_clear_error(tmp_path):
    f = _trace(tmp_path / "rank00000.mst", b'{"rank": 0, "world": ')
    with pytest.raises(fmt.TraceFormatError, match="rank00000.mst: the header is not valid JSON"):
        fmt.read_rank(f)
    f = _trace(tmp_path / "rank00000.mst", b"[1, 2]")
    with pytest.raises(fmt.TraceFormatError, match="not a JSON object"):
        fmt.read_rank(f)


def test_a_yaml_alias_bomb_is_refused_quickly_with_a_short_message(tmp_path):
    items = ['&a0 ["hang=0:1", "hang=0:1"]']
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 12)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("inject: [" + ", ".join(items) + "]\n")
    assert bomb.stat().st_size < 1000
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        load_yaml(bomb)
    assert time.monotonic() - t0 < 5.0
    assert "aliases" in str(e.value) and len(str(e.value)) < 500


def test_invalid_utf8_in_jsonl_names_the_file_and_line(tmp_path):
    from megatronapp.data.dataset import DataError, _read_jsonl

    f = tmp_path / "data.jsonl"
    f.write_bytes(b'{"text": "fine"}\n{"text": "also fine"}\n{"text": "bad \xff\xfe"}\n')
    with pytest.raises(DataError, match=r"data.jsonl:3: not UTF-8"):
        _read_jsonl(f)

"""The tracer's writer thread packs what it drains into one columnar block per flush, fields intact."""
from __future__ import annotations

import struct

from megatronapp import tracing
from megatronapp.scan.read.format import MAGIC, read_rank
from megatronapp.scan.record.tracer import Tracer, base_header


def _span_blocks(path) -> list[bytes]:
    data, pos, tags = path.read_bytes(), len(MAGIC), []
    while pos + 12 <= len(data):
        tag, length, _ = struct.unpack_from("<4sII", data, pos)
        if tag in (b"SPAN", b"COLS"):
            tags.append(tag)
        pos += 12 + length
    return tags


def test_one_block_per_flush_with_every_field(tmp_path):
    path = tmp_path / "rank00000.mst"
    tr = Tracer(path, base_header(0, 2, (0, 0, 0), (1, 1, 2)), granularity="full", flush_s=3600)
    tracing.install(tr)
    try:
        tr.step(0, True)
        for i in range(3000):  # more than RankWriter's row buffer would hold as one block
            with tracing.span("forward", "compute", chunk=1, microbatch=i % 4):
                pass
            tracing.close_span(tracing.open_span("send", "comm", group="pp.act.up", group_ranks=(0, 1), seq=i,
                                                 peer=1, bytes=4096))
        hung = tracing.open_span("all_reduce", "comm", group="dp", group_ranks=[0, 1], seq=0, bytes=8)
        tr.step(0, False)
        tr.flush_now()
        assert _span_blocks(path) == [b"COLS"]  # 6,000 spans: by column, the smaller block
        t = read_rank(path)  # readable while the tracer runs: the flushed prefix is a valid file
        sends = t.name == t.names.index("send")
        assert sends.sum() == 3000 and list(t.seq[sends][:3]) == [0, 1, 2] and set(t.peer[sends]) == {1}
        assert set(t.nbytes[sends]) == {4096} and t.groups[t.gid[sends][0]] == ("pp.act.up", (0, 1))
        fw = t.name == t.names.index("forward")
        assert list(t.mb[fw][:5]) == [0, 1, 2, 3, 0] and set(t.chunk[fw]) == {1} and set(t.gid[fw]) == {-1}
        # Opened records: every send, the step, and the all-reduce that never closes (a hang leaves it on disk).
        opened = [t.names[k] for k in t.opened["name"]]
        assert opened.count("send") == 3000 and opened.count("all_reduce") == 1 and opened.count("step") == 1
        tracing.close_span(hung)
    finally:
        tracing.uninstall(tr)
        tr.close()
    assert read_rank(path).problems == []

"""The ablation's rows are cumulative and valid: each adds exactly its technique to the row before."""
from __future__ import annotations

import pytest
from benchmarks import ablation_rows as ab

from megatronapp.config import RunConfig, validate


@pytest.mark.parametrize("layout", list(ab.LAYOUTS))
def test_rows_add_one_technique_each_and_validate(layout):
    rows = ab.row_configs(ab.LAYOUTS[layout], ab.FULL)
    assert len(rows) == len(ab.ROWS)
    cfgs = [RunConfig.from_dict(r) for r in rows]
    for c in cfgs:
        validate(c, 4)
    base, block, overlap, data, lamb, zero = cfgs
    assert not base.parallel.dp_overlap and not base.parallel.pp_overlap and base.train.data_prefetch == 0
    assert not base.model.parallel_block and base.model.sliding_window is None
    assert block.model.parallel_block and block.model.sliding_window == ab.FULL["seq"] // 4
    assert overlap.parallel.dp_overlap and overlap.parallel.pp_overlap
    assert overlap.parallel.tp_comm_overlap == (layout.startswith("tp"))  # only with sequence parallelism
    assert data.train.data_prefetch > 0 and data.train.optimizer == "adamw"
    assert lamb.train.optimizer == "lamb" and lamb.train.global_batch_size == 4 * data.train.global_batch_size
    assert lamb.parallel.microbatches == 4 * data.parallel.microbatches  # same microbatch size, 4x the tokens
    assert zero.parallel.zero == 1 and base.parallel.zero == 0

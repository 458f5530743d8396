"""The planner counts the boundary bytes the engine sends: its transport term for a run equals the engine's own
peak of messages in flight (``PipelineEngine.counters()``) under bf16-mixed, for each way the boundary dtype and the
weight dtype decide what crosses. With float32 weights (``strategy.weight_dtype=null``) a GPT's residual stream is
float32 under autocast: ``strategy.boundary_dtype=null`` sends it so, the default (``"auto"``) casts it to bfloat16;
with the default bfloat16 weight versions the stream is bfloat16 either way. Before 0.7.0 the planner read the
boundary's bytes from the precision alone (issue 61: it planned half the bytes that cross under ``null``)."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_pd2bw.engine.comm.transport import HEADER_SIZE

from .launch import torchrun_script

SCRIPT = Path(__file__).with_name("run_boundary_bytes.py")
BASE = ["trainer.precision=bf16-mixed", "trainer.devices=2", "global_batch_size=8", "micro_batch_size=2"]
RUNS = {
    "f32-null": ["strategy.weight_dtype=null", "strategy.boundary_dtype=null"],
    "f32-auto": ["strategy.weight_dtype=null", "strategy.boundary_dtype=auto"],
    "bf16-null": ["strategy.boundary_dtype=null"],
}


def measured(folder: Path, name: str) -> list[dict]:
    torchrun_script(SCRIPT, [str(folder), name, *BASE, *RUNS[name]], world=2, timeout=300)
    return [json.loads((folder / f"boundary-{name}-rank{rank}.json").read_text()) for rank in (0, 1)]


def test_the_planners_transport_term_is_what_the_engine_sends(tmp_path):
    runs = {name: measured(tmp_path, name) for name in RUNS}
    header = HEADER_SIZE * 8  # the first message of a boundary carries its shapes (int64), held until settled
    for name, records in runs.items():
        for record in records:
            planned, sent = record["planned_transport_bytes"], record["engine_transport_bytes"]
            assert 0 < planned <= sent <= planned + header, (name, record)
    for rank in (0, 1):  # float32 crosses where nothing casts it: twice the bytes of bfloat16
        assert (
            runs["f32-null"][rank]["planned_transport_bytes"] == 2 * runs["f32-auto"][rank]["planned_transport_bytes"]
        )
        assert runs["bf16-null"][rank]["planned_transport_bytes"] == runs["f32-auto"][rank]["planned_transport_bytes"]

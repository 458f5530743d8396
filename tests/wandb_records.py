"""Read an offline wandb run (``run-*.wandb``) without an account or a network: history rows and config.

The file is wandb's record log (LevelDB log layout): a 7-byte header ``:W&B``, magic 0xBEE1, version 0,
then 32 KiB blocks of records, each ``crc32 (4) | length (2) | type (1) | payload``, a protobuf
``Record`` split FULL or FIRST/MIDDLE.../LAST across blocks."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1 and version == 0, "not a wandb run file"
    out, pending, offset = [], b"", HEADER
    while offset + HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < HEADER:  # the rest of a block too small for a header is padding
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + HEADER])
        payload = data[offset + HEADER : offset + HEADER + length]
        offset += HEADER + length
        if kind == 0 and length == 0:
            break
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            out.append(pending)
            pending = b""
    return out


def read_run(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(history rows, config) of the offline run in ``run_dir``."""
    from wandb.proto import wandb_internal_pb2 as pb

    history, config = [], {}
    for raw in records(next(Path(run_dir).glob("run-*.wandb"))):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        elif kind == "config":
            for item in record.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return history, config

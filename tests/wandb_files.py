"""Reading a W&B run file (`run-<id>.wandb`) back: the records wandb wrote, without wandb's service.

The file is a `:W&B` header (magic 0xBEE1, a version byte) followed by LevelDB-log framing: 32 KiB
blocks of chunks, each `crc32c:u32, length:u16, type:u8` then the bytes, a record split over
FIRST/MIDDLE/LAST chunks where it crosses a block. Each record is a protobuf `Record` of wandb's schema.
"""
import json
import struct

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path):
    from wandb.proto import wandb_internal_pb2

    buf = open(path, "rb").read()
    assert buf[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(buf):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", buf[pos:pos + HEADER])
        data, pos = buf[pos + HEADER:pos + HEADER + length], pos + HEADER + length
        if kind in (FIRST, MIDDLE):
            pending += data
            continue
        if kind not in (FULL, LAST):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending + data)
        pending = b""
        yield record


def history(path, step_key="training/global_step"):
    """{step: {key: value}} of every `wandb.log` call, by the step its row names in `step_key` (the x axis
    hybridrl's writer defines; W&B's own `_step` counts calls); rows of one step merged in logging order."""
    out = {}
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            out.setdefault(int(row[step_key]), {}).update(row)
    return out


def step_metrics(path):
    """{metric name or glob: the metric W&B plots it against} of the run's `define_metric` calls."""
    out = {}
    for r in records(path):
        if r.WhichOneof("record_type") == "metric" and r.metric.step_metric:
            out[r.metric.name or r.metric.glob_name] = r.metric.step_metric
    return out


def config(path):
    """The run's config as wandb stored it (the last value of each top-level key)."""
    out = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        items = r.config.update if kind == "config" else r.run.config.update if kind == "run" else ()
        out.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return out

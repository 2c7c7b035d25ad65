"""Reads TensorBoard event files back for the tests (tensorboardX writes them but has no reader; the `tensorboard`
package is not a dependency)."""

import os
import struct
from pathlib import Path


def _tfrecords(path: Path):
    """Payloads of a TFRecord file: [u64 length][u32 crc][payload][u32 crc] per record (CRCs not checked)."""
    data = path.read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        if pos + 12 + length + 4 > len(data):
            break  # a record cut short by a kill
        yield data[pos + 12:pos + 12 + length]
        pos += 12 + length + 4


def read_tensorboard_scalars(logdir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` from every event file in ``logdir``, as TensorBoard would show them.

    Event files are read in name order (their names start with the creation time); a SessionLog START event at
    step ``s`` (written for ``purge_step``) hides every earlier-read value at a step >= ``s``, as TensorBoard does.
    """
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        for payload in _tfrecords(path):
            ev = event_pb2.Event.FromString(payload)
            if ev.HasField("session_log") and ev.session_log.status == ev.session_log.START:
                scalars = {tag: [(s, v) for s, v in pts if s < ev.step] for tag, pts in scalars.items()}
            if ev.HasField("summary"):
                for val in ev.summary.value:
                    if val.HasField("simple_value"):
                        scalars.setdefault(val.tag, []).append((int(ev.step), float(val.simple_value)))
    return scalars

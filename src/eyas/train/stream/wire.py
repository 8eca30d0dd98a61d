"""A stream's messages over a torch.distributed process group of two (gloo: TCP between hosts): the trainer (rank 0)
and a producer on another host (rank 1). No pickling: every message is tensors whose sizes the header gives.

The trainer asks, the producer answers, one exchange at a time (gloo matches sends and receives in order): a request
is an int64 [6] tensor ``[op, a, b, c, d, e]``; every answer starts with an int64 [8] header
``[status, key0, key1, key2, samples, error bytes, 0, 0]``; an acknowledgement (status 2) is the header alone, an error
answer (status 1) carries its message as UTF-8 bytes, a batch (status 0) each sample's length, then the tensors of :data:`NAMES` (the fp8 scales for an fp8 stream),
each as its bytes.
"""

from __future__ import annotations

import torch

from eyas.store.shards import DTYPES

START, NEXT, HOLDOUT, STOP = 1, 2, 3, 4  # the trainer's requests
OK, ERROR, ACK = 0, 1, 2  # an answer's status (ACK: a request done, nothing to carry)
NAMES = ("input_ids", "loss_mask", "aux", "final")
SCALES = ("aux_scale", "final_scale")
_REQUEST, _HEADER = 6, 8


def send_request(group, op: int, *args: int) -> None:
    """The trainer's request ``op`` with up to five integer arguments."""
    request = torch.zeros(_REQUEST, dtype=torch.int64)
    request[0] = op
    request[1:1 + len(args)] = torch.tensor(args, dtype=torch.int64)
    group.send([request], 1, 0).wait()


def receive_request(group) -> list[int]:
    """The producer's next request: ``[op, a, b, c, d, e]``."""
    request = torch.empty(_REQUEST, dtype=torch.int64)
    group.recv([request], 0, 0).wait()
    return request.tolist()


def send_answer(group, key: tuple[int, int, int], payload: dict) -> None:
    """A batch (a :func:`eyas.train.stream.producer.payload`) under ``key``: (epoch, index, batch), or (0, 0, b)."""
    tensors = payload["tensors"]
    header = torch.tensor([OK, *key, len(payload["lengths"]), 0, 0, 0], dtype=torch.int64)
    group.send([header], 0, 0).wait()
    group.send([torch.tensor(payload["lengths"], dtype=torch.int64)], 0, 0).wait()
    for name in NAMES + (SCALES if "aux_scale" in tensors else ()):
        group.send([_as_bytes(tensors[name])], 0, 0).wait()


def send_ack(group) -> None:
    """An answer that carries nothing (to START)."""
    group.send([torch.tensor([ACK, 0, 0, 0, 0, 0, 0, 0], dtype=torch.int64)], 0, 0).wait()


def send_error(group, line: str) -> None:
    """An error answer: the producer failed, in one line."""
    data = torch.frombuffer(bytearray(line.encode("utf-8")), dtype=torch.uint8)
    group.send([torch.tensor([ERROR, 0, 0, 0, 0, data.numel(), 0, 0], dtype=torch.int64)], 0, 0).wait()
    group.send([data], 0, 0).wait()


def receive_answer(group, dtype: str, widths: tuple[int, int]) -> tuple[tuple[int, int, int], dict] | str | None:
    """The producer's answer: (key, payload) for a batch of states stored as ``dtype`` whose aux and final rows are
    ``widths`` wide, the error line it sent, or None for an acknowledgement."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    group.recv([header], 1, 0).wait()
    status, key0, key1, key2, samples, error_bytes = header.tolist()[:6]
    if status == ACK:
        return None
    if status == ERROR:
        data = torch.empty(error_bytes, dtype=torch.uint8)
        group.recv([data], 1, 0).wait()
        return bytes(data.tolist()).decode("utf-8")
    lengths = torch.empty(samples, dtype=torch.int64)
    group.recv([lengths], 1, 0).wait()
    tokens = int(lengths.sum())
    aux, final = widths
    shapes = {"input_ids": ((tokens,), torch.int32), "loss_mask": ((tokens,), torch.uint8),
              "aux": ((tokens, aux), DTYPES[dtype]), "final": ((tokens, final), DTYPES[dtype])}
    if dtype == "fp8":
        shapes.update(aux_scale=((tokens, aux // final), torch.float32), final_scale=((tokens, 1), torch.float32))
    tensors = {}
    for name, (shape, kind) in shapes.items():
        data = torch.empty(int(torch.Size(shape).numel()) * kind.itemsize, dtype=torch.uint8)
        group.recv([data], 1, 0).wait()
        tensors[name] = data.view(kind).reshape(shape)
    return (key0, key1, key2), {"lengths": lengths.tolist(), "tensors": tensors}


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 tensor (gloo sends any dtype so, fp8 included)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)

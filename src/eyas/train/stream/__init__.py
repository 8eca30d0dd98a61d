"""Streaming capture (``eyas train --stream``): a producer — a process, or a thread of the trainer's where HF runs the
target on the trainer's own GPU (``--stream-producer``) — runs the target over DATA_DIR's samples, batch by batch in
the order the trainer will take them, and hands each batch's states to the trainer through a bounded buffer;
capture and training overlap and nothing but checkpoints is written.

- :mod:`eyas.train.stream.producer`: the producer's loop, as a process or a thread (the target loaded with HF on
  ``--producer-device``, or eyas' vLLM worker).
- :mod:`eyas.train.stream.source`: the trainer's end: a source of batches like a store's, and the holdout on request.

The states travel in storage form (``--stream-dtype``, as capture's ``--dtype``) and are decoded on the trainer's
device by the rule a store's rows are decoded by, so a streamed run reads what an offline run reads from a store
captured in the same batches (:func:`eyas.capture.batch.capture_batch`).
"""

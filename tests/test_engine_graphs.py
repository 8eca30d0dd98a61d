"""StepGraphs off a GPU: steps run as plain calls, and a step that cannot be recorded falls back.

The recording itself needs CUDA (BENCHMARKS.md has the H200 runs: graph-replayed decoding equals
eager decoding token for token in fp32). Here: a CUDA-enabled StepGraphs whose recording fails —
as it does on this machine, which has no CUDA — warns once, turns itself off and runs the step
eagerly, so decoding goes on; and pinned input buffers degrade to plain copies off CUDA.
"""

import logging

import torch

from eyas.engine.graphs import InputBuffer, StepGraphs


def test_a_step_that_cannot_be_recorded_runs_eagerly_with_one_warning(caplog):
    graphs = StepGraphs(torch.device("cuda"), enabled=True, name="the test step")
    assert graphs.enabled  # asked for on a CUDA device
    calls = []

    def step():
        calls.append(1)
        return torch.tensor([len(calls)])

    with caplog.at_level(logging.WARNING, logger="eyas.engine.graphs"):
        first = graphs.run("k", step)
        second = graphs.run("k", step)
    assert first.tolist() == [1] and second.tolist() == [2]  # ran each time, eagerly
    assert not graphs.enabled and len(graphs) == 0
    warnings = [r for r in caplog.records if "cannot be replayed from a CUDA graph" in r.getMessage()]
    assert len(warnings) == 1 and "the test step" in warnings[0].getMessage()
    assert graphs.ensure("other", step) is False  # off: nothing to record, nothing to refill


def test_steps_off_cuda_are_plain_calls_and_buffers_plain_copies():
    graphs = StepGraphs(torch.device("cpu"))
    assert not graphs.enabled
    assert graphs.run("k", lambda: 7) == 7
    buffer = InputBuffer((2, 3), torch.long, torch.device("cpu"))
    source = torch.arange(6).view(2, 3)
    assert torch.equal(buffer.fill(source), source) and buffer.tensor.data_ptr() != source.data_ptr()

"""benchmarks/stream_trace_gpu.py's reading of a torch.profiler trace: the GPU's idle gaps with the CUDA calls in
progress, and each thread's host waits (no op, no CUDA call) with the op around and after each."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_a_wait_inside_an_op_is_found_with_the_op_around_it_and_the_op_after(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from stream_trace_gpu import explain

    trace = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "tid": 1, "args": {"name": "trainer"}},
        x("k1", "kernel", 0, 1000, tid=9, stream=7), x("k2", "kernel", 1000, 1000, tid=9, stream=13),
        x("k3", "kernel", 12000, 1000, tid=9, stream=7),  # the GPU idle 10 ms between k2 and k3
        x("cudaLaunchKernel", "cuda_runtime", 100, 10), x("aten::mm", "cpu_op", 200, 300),
        x("_SoftCrossEntropy", "cpu_op", 400, 11000),  # around the wait
        x("TorchDynamo Cache Lookup", "cpu_op", 10500, 50), x("cudaLaunchKernel", "cuda_runtime", 10600, 10),
    ]}
    summary = explain(trace, top=4)
    assert summary["kernels"] == 3 and summary["kernel_ms_by_stream"] == {"7": 2.0, "13": 1.0}
    assert [(g["ms"], g["at_ms"]) for g in summary["gaps"]] == [(10.0, 2.0)]
    assert summary["busy_share"] == 3000 / 13000
    [wait] = summary["host_waits"]["trainer"]
    assert (wait["ms"], wait["at_ms"], wait["inside"], wait["next"]) == (10.0, 0.5, "_SoftCrossEntropy",
                                                                         "TorchDynamo Cache Lookup")

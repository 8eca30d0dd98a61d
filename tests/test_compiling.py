"""eyas.compiling: one compiled call at a time in a process, so that a thread's compiled call never meets another
thread's compilation (the FX tracing flag and the patched ``nn.Module.__call__`` are process-wide)."""

import threading
import time

import torch

from eyas import compiling


def test_a_compiled_call_waits_while_another_thread_compiles(monkeypatch):
    entered, release = threading.Event(), threading.Event()
    real_compile = torch.compile

    def tracing_backend(graph, example_inputs):
        """Stands for inductor: the compiling thread FX-traces (here a module that waits until released)."""

        class Waits(torch.nn.Module):
            def forward(self, x):
                entered.set()
                release.wait(30)
                return x

        torch.fx.symbolic_trace(Waits())
        return graph.forward

    def compile_with(backend):
        monkeypatch.setattr(torch, "compile", lambda fn, dynamic, options: real_compile(fn, dynamic=dynamic,
                                                                                        backend=backend))

    compile_with("eager")
    ready = compiling.compiled(lambda x: x + 1, dynamic=False)
    x = torch.ones(3)
    assert torch.equal(ready(x), x + 1)  # compiled before the race
    compile_with(tracing_backend)
    slow = compiling.compiled(lambda x: x * 3, dynamic=False)

    results, errors = {}, []

    def call(name, fn):
        try:
            results[name] = fn(x)
        except Exception as err:  # noqa: BLE001 (the test reports what the thread raised)
            errors.append((name, err))

    compiling_thread = threading.Thread(target=call, args=("slow", slow))
    compiling_thread.start()
    assert entered.wait(30), "the compilation never reached its FX trace"
    # torch 2.11 (the GPU image's) refuses a compiled call from another thread now ("Detected that you are using FX to
    # symbolically trace a dynamo-optimized function"); 2.13 marks the whole process as compiling instead. Either way
    # eyas' compiled call waits for the compilation to end:
    waiting = threading.Thread(target=call, args=("ready", ready))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive(), "eyas' compiled call ran while another thread's compilation was tracing"
    release.set()
    compiling_thread.join(30)
    waiting.join(30)
    assert not errors, errors
    assert torch.equal(results["slow"], x * 3) and torch.equal(results["ready"], x + 1)


def test_the_lock_is_reentrant_a_compiled_function_may_call_another():
    outer_calls = []
    inner = compiling.compiled(lambda x: x + 1, dynamic=False)

    def outer(x):
        outer_calls.append(1)
        return inner(x) * 2

    wrapped = compiling.compiled(outer, dynamic=False)
    with compiling._ONE_AT_A_TIME:  # a thread holding it (a compiled call under way) may call one more
        assert torch.equal(wrapped(torch.ones(2)), torch.full((2,), 4.0))


def test_the_lock_goes_to_the_thread_that_waited_not_back_to_the_one_that_released_it():
    lock, order, asked = compiling.FairLock(), [], threading.Event()

    def other():
        asked.set()
        with lock:
            order.append("other")

    with lock:  # this thread holds it when the other asks
        waiter = threading.Thread(target=other)
        waiter.start()
        asked.wait(10)
        deadline = time.monotonic() + 10
        while not lock._waiting and time.monotonic() < deadline:
            time.sleep(0.001)
    for _ in range(50):  # released, then asked for again at once, as a producer calls its layers one after another
        with lock:
            order.append("this")
    waiter.join(10)
    assert order[0] == "other", order[:5]


def test_eyas_compiles_only_through_eyas_compiling():
    """A torch.compile call elsewhere would run outside the lock, and a thread beside it could die of it again."""
    from pathlib import Path

    root = Path(compiling.__file__).parent
    elsewhere = [f"{path.relative_to(root)}:{n}" for path in root.rglob("*.py") if path.name != "compiling.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if "torch.compile(" in line]
    assert not elsewhere, elsewhere

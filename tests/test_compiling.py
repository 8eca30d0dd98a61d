"""eyas.compiling's gate: compiled calls side by side, a compilation alone, so that a thread's compiled call never meets
another thread's compilation (the FX tracing flag and the patched ``nn.Module.__call__`` are process-wide) and never
waits for another thread's compiled call either."""

import threading

import torch

from eyas import compiling

REAL_COMPILE = torch.compile  # a test may swap the backend more than once


def compile_with(monkeypatch, backend):
    """eyas.compiling's torch.compile from now on with dynamo's ``backend`` (its guards and stances; no inductor)."""
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic, options: REAL_COMPILE(fn, dynamic=dynamic,
                                                                                    backend=backend))


def test_a_compiled_call_waits_while_another_thread_compiles(monkeypatch):
    entered, release = threading.Event(), threading.Event()

    def tracing_backend(graph, example_inputs):
        """Stands for inductor: the compiling thread FX-traces (here a module that waits until released)."""

        class Waits(torch.nn.Module):
            def forward(self, x):
                entered.set()
                release.wait(30)
                return x

        torch.fx.symbolic_trace(Waits())
        return graph.forward

    compile_with(monkeypatch, "eager")
    ready = compiling.compiled(lambda x: x + 1, dynamic=False)
    x = torch.ones(3)
    assert torch.equal(ready(x), x + 1)  # compiled before the race
    compile_with(monkeypatch, tracing_backend)
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


def eager_compiled(monkeypatch, fn, dynamic=False):
    """``fn`` compiled by eyas.compiling with dynamo's eager backend."""
    compile_with(monkeypatch, "eager")
    return compiling.compiled(fn, dynamic=dynamic)


def blocking(inside: threading.Event, release: threading.Event):
    """A function whose compiled call stays under way until ``release`` (a graph break, then a wait in eager Python)."""
    def fn(x):
        y = x + 1
        torch._dynamo.graph_break()
        inside.set()
        release.wait(30)
        return y * 2

    return fn


def test_compiled_calls_run_side_by_side(monkeypatch):
    """A thread's compiled call does not wait for another thread's (a lock around every call made the producer thread's
    layers and the trainer's loss take turns: idle GPU time each step)."""
    inside, release = threading.Event(), threading.Event()
    slow = eager_compiled(monkeypatch, blocking(inside, release))
    quick = compiling.compiled(lambda x: x - 1, dynamic=False)
    x = torch.ones(3)
    release.set()
    assert torch.equal(slow(x), (x + 1) * 2) and torch.equal(quick(x), x - 1)  # both compiled: warm
    release.clear(), inside.clear()
    results = {}
    holder = threading.Thread(target=lambda: results.update(slow=slow(x)))
    holder.start()
    try:
        assert inside.wait(30)
        beside = threading.Thread(target=lambda: results.update(quick=quick(x)))
        beside.start()
        beside.join(10)
        assert not beside.is_alive(), "a compiled call waited for another thread's compiled call to end"
        assert torch.equal(results["quick"], x - 1)
    finally:
        release.set()
        holder.join(30)
    assert torch.equal(results["slow"], (x + 1) * 2)


def test_a_compilation_waits_for_the_calls_under_way_and_runs_alone(monkeypatch):
    """A warm function meeting a new shape (dynamic=False: it recompiles) while another thread's compiled call is under
    way is refused, waits for that call to end, and compiles alone; both results are right, and dynamo's stance is
    what it was."""
    from torch._dynamo import eval_frame

    inside, release = threading.Event(), threading.Event()
    slow = eager_compiled(monkeypatch, blocking(inside, release))
    grows = compiling.compiled(lambda x: x * 3, dynamic=False)
    x = torch.ones(3)
    release.set()
    slow(x), grows(x)
    release.clear(), inside.clear()
    results, errors = {}, []

    def call(name, fn, arg):
        try:
            results[name] = fn(arg)
        except Exception as err:  # noqa: BLE001 (the test reports what the thread raised)
            errors.append((name, err))

    holder = threading.Thread(target=call, args=("slow", slow, x))
    holder.start()
    assert inside.wait(30)
    new_shape = torch.ones(5)
    compiler = threading.Thread(target=call, args=("grows", grows, new_shape))
    compiler.start()
    compiler.join(0.3)
    assert compiler.is_alive(), "a compilation started while another thread's compiled call was under way"
    release.set()
    holder.join(30), compiler.join(30)
    assert not errors, errors
    assert torch.equal(results["slow"], (x + 1) * 2) and torch.equal(results["grows"], new_shape * 3)
    assert eval_frame._stance.stance == "default"


def test_a_compiled_function_may_call_another():
    inner = compiling.compiled(lambda x: x + 1, dynamic=False)

    def outer(x):
        return inner(x) * 2

    wrapped = compiling.compiled(outer, dynamic=False)
    assert torch.equal(wrapped(torch.ones(2)), torch.full((2,), 4.0))
    assert torch.equal(wrapped(torch.ones(4)), torch.full((4,), 4.0))  # a new shape: both compile again, alone


def test_an_error_of_the_function_reaches_the_caller_and_leaves_the_gate_open(monkeypatch):
    def fails(x):
        raise RuntimeError("the function's own error")

    broken = eager_compiled(monkeypatch, fails)
    for _ in range(2):
        try:
            broken(torch.ones(2))
        except RuntimeError as err:
            assert "the function's own error" in str(err)
        else:
            raise AssertionError("the error was swallowed")
    fine = compiling.compiled(lambda x: x + 1, dynamic=False)
    assert torch.equal(fine(torch.ones(2)), torch.full((2,), 2.0))
    assert compiling._GATE._running == 0 and not compiling._GATE._alone


def test_eyas_compiles_only_through_eyas_compiling():
    """A torch.compile call elsewhere would run outside the gate, and a thread beside it could die of it again."""
    from pathlib import Path

    root = Path(compiling.__file__).parent
    elsewhere = [f"{path.relative_to(root)}:{n}" for path in root.rglob("*.py") if path.name != "compiling.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if "torch.compile(" in line]
    assert not elsewhere, elsewhere

"""Progress off a terminal (nohup, CI, SLURM): plain lines with count, rate and ETA, never silence."""

import io
import time

from eyas.progress import _LogLines, progress_bar, rate_text


def test_log_lines_give_count_rate_and_eta():
    out = io.StringIO()
    lines = _LogLines("train", 10, "step", every=0.0, stream=out)
    lines(3)  # a resumed run's steps: counted, not timed
    time.sleep(0.01)
    lines(1)
    lines.note("loss 1.2")
    lines.line()
    text = out.getvalue().splitlines()
    assert text[0].startswith("train: 3/10 step (30 %), 0:00:00 elapsed")
    assert text[1].startswith("train: 4/10 step (40 %), ") and "step/s, ETA 0:00:" in text[1]
    assert text[-1].endswith("loss 1.2")
    assert rate_text(0.5, "conv") == "30.0 conv/min" and rate_text(2, "tok") == "2.0 tok/s"


def test_progress_bar_off_a_terminal_writes_lines(capsys):
    with progress_bar("capture", total=4, unit="tok", log_every=0.0) as bar:
        for _ in range(4):
            bar()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("capture: 1/4 tok (25 %)")
    assert err[-1].startswith("capture: 4/4 tok (100 %)")  # the last line when the loop ends
    with progress_bar("quiet", total=2, enabled=False, log_every=0.0) as bar:
        bar(2)
    assert capsys.readouterr().err == ""

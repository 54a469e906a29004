import torch

from lightning_elastic.timing import StepTimer


def test_cpu_intervals_come_from_the_clock() -> None:
    ticks = iter([10.0, 10.25, 11.0, 11.5])
    timer = StepTimer(torch.device("cpu"), clock=lambda: next(ticks))
    timer.start()
    timer.stop()
    timer.start()
    timer.stop()
    timer.stop()  # no interval open: ignored
    assert timer.pop() == [0.25, 0.5]
    assert timer.pop() == []

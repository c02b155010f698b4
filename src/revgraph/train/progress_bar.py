"""The progress bar of :meth:`revgraph.Trainer.fit` (moved out of trainer.py, which stays under its size)."""

from __future__ import annotations


class Bar:
    """A rich progress bar over steps with the loss and throughput, or nothing when ``enabled`` is false."""

    def __init__(self, enabled: bool, console, description: str, total: int, done: int = 0):
        self.progress = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[rate]:,.0f} samples/s"),
                TimeElapsedColumn(), console=console,
            )
            self.task = self.progress.add_task(description, total=total, completed=done, loss=float("nan"), rate=0.0)

    def __enter__(self):
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def advance(self, description: str, loss: float, rate: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=1, description=description, loss=loss, rate=rate)

"""The progress bar of :meth:`revgraph.Trainer.fit` (moved out of trainer.py, which stays under its size)."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text


class Bar:
    """A rich progress bar over steps with the loss and throughput, or nothing when ``enabled`` is false. Before
    the first step the loss and the rate show ``-`` (there is none yet, and ``nan`` would read as a diverged
    run); on a narrow console the columns that do not fit are left out, the step count last
    (:func:`fitting_columns`)."""

    def __init__(self, enabled: bool, console, description: str, total: int, done: int = 0):
        self.progress = None
        if enabled:
            self.progress = _FittedProgress(console=console)
            self.task = self.progress.add_task(description, total=total, completed=done, loss=None, rate=None)

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


#: the columns in display order; the step count and the loss are kept at any width, then these in this order
_SHOWN = ("description", "bar", "steps", "loss", "rate", "elapsed")
_OPTIONAL = ("description", "elapsed", "rate")
_BAR_MIN, _BAR_MAX = 10, 40


def fitting_columns(width: int, tasks, console) -> list:
    """The rich progress columns for a console ``width`` columns wide: the step count (``12/100``) and the loss
    always, then the description, the elapsed time and the rate while they fit (measured on ``tasks``, one space
    between columns), then a bar of 10 to 40 cells in what is left. At 80 columns and more everything shows;
    rich would otherwise crop the last columns, the step count among them."""
    made = {"description": TextColumn("{task.description}"), "steps": MofNCompleteColumn(),
            "loss": _FieldColumn("loss", "loss {:.4f}", "loss -"),
            "rate": _FieldColumn("rate", "{:,.0f} samples/s", "- samples/s"), "elapsed": TimeElapsedColumn()}

    def cells(name: str) -> int:
        return max((console.measure(made[name].render(t)).maximum for t in tasks), default=0)

    chosen = ["steps", "loss"]
    used = cells("steps") + 1 + cells("loss")
    for name in _OPTIONAL:
        if used + 1 + cells(name) <= width - 1:
            chosen.append(name)
            used += 1 + cells(name)
    if width - 1 - used - 1 >= _BAR_MIN:
        made["bar"] = BarColumn(bar_width=min(_BAR_MAX, width - 1 - used - 1))
        chosen.append("bar")
    return [made[name] for name in _SHOWN if name in chosen]


class _FittedProgress(Progress):
    """rich's Progress with :func:`fitting_columns` at each refresh (a resized terminal is followed)."""

    def make_tasks_table(self, tasks):
        tasks = list(tasks)
        if "live" not in vars(self):  # (called once while Progress.__init__ makes its Live, before any task)
            return super().make_tasks_table(tasks)
        self.columns = tuple(fitting_columns(self.console.width, tasks, self.console))
        return super().make_tasks_table(tasks)


class _FieldColumn(ProgressColumn):
    """A task field through ``fmt``, or ``missing`` while it is ``None`` (before the first step)."""

    def __init__(self, field: str, fmt: str, missing: str):
        super().__init__()
        self.field, self.fmt, self.missing = field, fmt, missing

    def render(self, task) -> Text:
        value = task.fields.get(self.field)
        return Text(self.missing if value is None else self.fmt.format(value))

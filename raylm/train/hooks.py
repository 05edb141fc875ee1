"""The hook interface of the training loop: health checks, sweeps and the stability guard
subclass it without importing the loop."""

from __future__ import annotations

from raylm.train.state import Run


class Hook:
    """Callbacks around each step."""

    def on_train_start(self, run: Run) -> None: ...

    def on_step_begin(self, run: Run, step: int) -> None: ...

    def on_step_end(self, run: Run, step: int, metrics: dict) -> None: ...

    def on_step_abandoned(self, run: Run, step: int) -> None:
        """The step began but never ends: the stability guard rolled the run back in it.
        Release what on_step_begin took (its metrics are not written)."""

    def on_train_end(self, run: Run, metrics: dict) -> None: ...

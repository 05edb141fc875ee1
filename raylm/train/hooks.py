"""The hook interface of the training loop, in a module of its own so that hooks (health
checks, sweeps, the stability guard) can subclass it without importing the loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raylm.train.loop import Run


class Hook:
    """Callbacks around each step; the stability guard and sweeps plug in here."""

    def on_train_start(self, run: "Run") -> None: ...

    def on_step_begin(self, run: "Run", step: int) -> None: ...

    def on_step_end(self, run: "Run", step: int, metrics: dict) -> None: ...

    def on_train_end(self, run: "Run", metrics: dict) -> None: ...

"""Run blocking calls side by side on daemon threads and fail fast: the HTTP call and the collective of a sync."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class _Task:
    """A callable run on a daemon thread (a hung rendezvous must not block interpreter exit); sets ``changed``
    when it ends."""

    def __init__(self, name: str, function: Callable[[], Any], changed: threading.Event):
        self.name = name
        self._function = function
        self._changed = changed
        self._done = threading.Event()
        self._result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"fastdistill-sync-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._function()
        except BaseException as error:  # re-raised in the caller's thread
            self.error = error
        finally:
            self._done.set()
            self._changed.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> Any:
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self._result


class TaskFailed(Exception):
    """A task of :func:`run_together` failed (``error``) or time ran out (``task`` None); :meth:`running` names the
    tasks still blocked."""

    def __init__(self, task: _Task | None, tasks: list[_Task], message: str | None = None):
        self.task = task
        self.tasks = tasks
        self.error = task.error if task is not None else None
        super().__init__(message or f"{task.name}: {type(self.error).__name__}: {self.error}")

    def running(self) -> list[str]:
        return [task.name for task in self.tasks if not task.done]


def run_together(functions: dict[str, Callable[[], Any]], timeout_s: float) -> dict[str, Any]:
    """Run ``functions`` on threads at once; return their results by name once all succeed.

    The first failure is raised as soon as it happens, without waiting for the others (a peer blocked in a
    collective that will never complete would otherwise hang the caller), as :class:`TaskFailed`; the same after
    ``timeout_s`` seconds.
    """
    changed = threading.Event()
    tasks = [_Task(name, function, changed) for name, function in functions.items()]
    deadline = time.monotonic() + timeout_s
    while True:
        changed.clear()
        for task in tasks:
            if task.done and task.error is not None:
                raise TaskFailed(task, tasks) from task.error
        if all(task.done for task in tasks):
            return {task.name: task.result() for task in tasks}
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pending = ", ".join(task.name for task in tasks if not task.done)
            raise TaskFailed(None, tasks, f"still running after {timeout_s:.0f} s: {pending}")
        changed.wait(remaining)

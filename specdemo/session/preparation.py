"""A pair's preparation as named steps with one progress line and an estimate, and what of it runs side by side.

The first start of a pair does the most: the pack's files joined and verified, the target's format measured, each
model converted into what the race reads, both loaded, the passes chosen, a warm-up, the cost curve. The steps
report through one callback, ``(fraction, message)``, as ``step 3 of 7 (about 40 s left): loading the target,
Converting ...``: each step's estimate starts from a guess made from the sizes involved, and once a step ends, the steps
left are scaled by how the finished ones compared with their guesses (a slower disk or CPU shows after a step).

What overlaps: the draft's weights are made ready in a process while the target's are (:class:`PreparedBeside`):
its files are joined and verified while the target's are, and it is converted while the target is. The target's
format measurement waits for the join and holds the conversion back, so that it runs alone on the cores; the
calibration runs after both.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..backends.loading import LoadSettings, bytes_to_convert, prepare_weights

logger = logging.getLogger(__name__)

Progress = Callable[[float, str], None]


MEASURING_FORMATS = "measuring the target's formats"
LOADING_TARGET = "loading the target"
LOADING_DRAFT = "loading the draft"
CHOOSING_PASSES = "choosing how the passes run"
WARMING_UP = "warming up"
CALIBRATING = "measuring the cost curve"

#: first guesses, in seconds, refined as steps finish (measured on a 2-core AMD EPYC: see docs/offline-pack.md):
#: measuring three formats on a few layers, converting a GB of GGUF, loading a converted model, a warm-up, a curve
GUESS_MEASURING, GUESS_CONVERT_PER_GB, GUESS_LOAD, GUESS_WARM_UP, GUESS_CALIBRATE = 25.0, 25.0, 5.0, 5.0, 15.0


@dataclass
class Step:
    """One named step and the seconds it is expected to take."""

    name: str
    estimate: float


@dataclass
class StepProgress:
    """Reports named steps through ``report`` as one fraction in [0, 1], with the seconds left."""

    report: Progress
    steps: list[Step]
    _index: int = -1
    _started: float = field(default_factory=lambda: time.perf_counter())
    _step_started: float = 0.0
    _spent_on_done: float = 0.0
    _estimated_done: float = 0.0

    def start(self, name: str, message: str = "") -> None:
        """Begin the step ``name`` (the steps before it count as done)."""
        self._finish_current()
        self._index = next(i for i, step in enumerate(self.steps) if step.name == name)
        self._step_started = time.perf_counter()
        self.within(0.0, message)

    def within(self, fraction: float, message: str = "") -> None:
        """How far the current step has come, and what it is doing."""
        step = self.steps[self._index]
        scale = self._scale()
        left = sum(s.estimate for s in self.steps[self._index + 1:]) * scale + step.estimate * scale * (1 - fraction)
        done = sum(s.estimate for s in self.steps[: self._index]) + step.estimate * fraction
        total = sum(s.estimate for s in self.steps)
        text = f"step {self._index + 1} of {len(self.steps)} (about {max(left, 1.0):.0f} s left): {step.name}"
        if message:  # last: a narrow progress line cuts the end, never the step or the estimate
            text += f", {message}"
        self.report(min(done / total, 1.0) if total else 1.0, text)

    def _finish_current(self) -> None:
        if self._index < 0:
            return
        spent = time.perf_counter() - self._step_started
        logger.info("Preparing: %s took %.1f s (estimated %.0f s)", self.steps[self._index].name, spent,
                    self.steps[self._index].estimate)
        self._spent_on_done += spent
        self._estimated_done += self.steps[self._index].estimate

    def _scale(self) -> float:
        """How the finished steps compared with their estimates (1 until one has finished)."""
        if self._estimated_done <= 0:
            return 1.0
        return min(max(self._spent_on_done / self._estimated_done, 0.25), 4.0)

    def within_step(self, fraction: float, message: str = "") -> None:
        """What the current step is doing, for callers that report only messages (their fractions ignored)."""
        self.within(0.0, message)

    def finish(self) -> float:
        """End the last step; the seconds all of them took."""
        self._finish_current()
        self._index = -1
        return time.perf_counter() - self._started


class PreparedBeside:
    """A model's weights made ready in a process of its own while the target's are: its files joined, verified and
    parsed at once, its conversion held back until :meth:`release` (so that nothing runs beside the target's format
    measurement) and then run on the other core beside the target's conversion (see :func:`~specdemo.backends.
    loading.prepare_weights`). A process, not a thread: the conversion is Python-bound in part, and two conversions
    in threads of one process took longer together (95 s) than one after the other (83 s)."""

    def __init__(self, source: str, settings: LoadSettings) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch thread pools
        # a pipe, not events: no semaphores to leak when the process is ended early, and the other side's end
        # reads as end-of-file when this process dies
        self._connection, child_end = context.Pipe()
        self._joined = self._released = False
        self.process = context.Process(target=_prepare_in_child, args=(source, settings, child_end),
                                       name="specdemo-prepare", daemon=True)
        self.process.start()
        child_end.close()

    def wait_joined(self) -> None:
        """Wait until its files are joined, verified and parsed (it then waits for :meth:`release`)."""
        while not self._joined and self.process.is_alive():
            self._joined = self._connection.poll(0.5)

    def release(self) -> None:
        """Let its conversion run."""
        if not self._released and self.process.is_alive():
            try:
                self._connection.send(True)
            except OSError:  # it ended already
                pass
        self._released = True

    def stop(self) -> None:
        """End it now (a preparation that failed on the target's side): a conversion cut here resumes next time."""
        if self.process.is_alive():
            self.process.terminate()
        self.process.join()
        self._connection.close()

    def wait(self) -> None:
        """Let its conversion run and wait for it to end."""
        self.release()
        self.process.join()
        self._connection.close()
        if self.process.exitcode:
            logger.info("Preparing beside the target ended with code %s", self.process.exitcode)


def _prepare_in_child(source: str, settings: LoadSettings, connection: Any) -> None:
    """The other process's work: join and parse, say so, wait to be released, convert. Its failures are left to
    the load that follows, which says what went wrong in one line."""
    try:
        try:
            prepare_weights(source, settings, convert=False)
        finally:
            connection.send(True)
        connection.recv()  # released (end-of-file: the parent is gone, and so is the need)
        prepare_weights(source, settings)
    except EOFError:
        raise SystemExit(0) from None
    except Exception as error:  # noqa: BLE001 - reported by the load that follows
        logger.info("Preparing %s beside the target failed: %s", source, error)
        raise SystemExit(1) from None


def prepare_beside(source: str | None, settings: LoadSettings) -> PreparedBeside | None:
    """Start preparing ``source``'s weights beside the target's: when it has GGUF weights still to convert (None
    otherwise, and when there is no source)."""
    if not source or not bytes_to_convert(source, settings):
        return None
    return PreparedBeside(source, settings)


def wait_beside(beside: PreparedBeside | None) -> None:
    """Let what :func:`prepare_beside` started finish, and wait for it (a failure there is left to the load that
    follows)."""
    if beside is not None:
        beside.wait()


def plan_steps(target: str, target_settings: LoadSettings, draft: str | None, measuring: bool,
               calibrating: bool) -> list[Step]:
    """The steps of preparing this pair, with first guesses from what has to be converted."""
    steps = [Step(MEASURING_FORMATS, GUESS_MEASURING)] if measuring else []
    steps.append(_loading(LOADING_TARGET, target, target_settings))
    if draft:
        steps.append(Step(LOADING_DRAFT, GUESS_LOAD))  # its conversion runs beside the target's
    steps += [Step(CHOOSING_PASSES, 1.0), Step(WARMING_UP, GUESS_WARM_UP)]
    if calibrating:
        steps.append(Step(CALIBRATING, GUESS_CALIBRATE))
    return steps


def loading_steps(target: str, target_settings: LoadSettings, drafts: list[tuple[str, str, LoadSettings]],
                  measuring: bool) -> list[Step]:
    """The steps of loading a target and its drafts (``(step name, source, settings)`` each) one after the other,
    as the bench does, with first guesses from what has to be converted."""
    steps = [Step(MEASURING_FORMATS, GUESS_MEASURING)] if measuring else []
    steps.append(_loading(LOADING_TARGET, target, target_settings))
    return steps + [_loading(name, source, settings) for name, source, settings in drafts]


def _loading(name: str, source: str, settings: LoadSettings) -> Step:
    """The step of loading ``source``, guessed from the GGUF bytes it converts first."""
    return Step(name, GUESS_LOAD + GUESS_CONVERT_PER_GB * bytes_to_convert(source, settings) / 1e9)

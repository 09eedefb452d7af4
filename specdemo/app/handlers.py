"""The app's Gradio handlers: the Run button's stream of views, the ``/race`` API, and the queue's validators.

Each handler is a thin layer over one :class:`~specdemo.session.racer.Racer`: it turns the inputs into a
:class:`~specdemo.session.request.RaceRequest`, reports loading progress, and turns each
:class:`~specdemo.session.state.RaceState` into the page's outputs (:func:`view`) or the API's JSON
(:func:`~specdemo.session.state.result_dict`). Tests drive :func:`make_handlers` directly.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import gradio as gr

from ..core.errors import InputError, first_line
from ..render.views import (
    figures_html,
    identical_html,
    pane_html,
    pane_stats_html,
    pane_titles,
    speedup_html,
)
from ..backends.suffix_trees import SuffixMemory
from ..session.memories import HOSTED_MEMORY, LOCAL_MEMORY, SuffixMemories
from ..session.racer import Prepared, Progress, Racer, log_refusal, race_settings
from ..session.request import RaceRequest
from ..session.state import RaceState, progress_dict, result_dict
from .charts import (
    acceptance_position_frame,
    accepted_length_frame,
    cost_plot_update,
    race_frame,
)
from .config import AppConfig, draft_length_of
from .spaces import gpu

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: the Run handler's outputs, in order (tests zip them with the yielded tuples)
OUTPUTS = (
    "plain_stats",
    "plain_output",
    "spec_stats",
    "spec_output",
    "speedup",
    "figures",
    "identical",
    "status",
    "race_plot",
    "length_plot",
    "position_plot",
    "result",
    "cost_plot",
)
#: the Run handler's inputs, in order
INPUTS = (
    "prompt",
    "pair",
    "target",
    "draft",
    "mode",
    "draft_tokens",
    "max_new_tokens",
    "temperature",
    "top_p",
    "seed",
    "dtype",
    "quantization",
    "chat",
)
#: the request's fields that a Run sets through a control of another name (a refusal is shown on that control)
RUN_ALIASES = {"num_draft_tokens_schedule": "draft_tokens", "num_draft_tokens": "draft_tokens"}
RACING_TEXT = "Racing… each side is timed only on its own work."


def compile_note(record: dict | None) -> str:
    """How both sides' target passes ran, when compiled (see ``--compile``): a sentence for the status line."""
    if not record or not record.get("compile_mode"):
        return ""
    seconds = record.get("compile_seconds") or 0.0
    took = f", compiled in {seconds:.1f} s before this pair and mode's first race" if seconds >= 0.1 else ""
    return f" Both sides ran compiled passes ({record.get('reason', '')}{took})."


def status_text(state: RaceState | None, load_seconds: float = 0.0) -> str:
    """The status line under the figures: racing, done with the speedup, or stopped and why."""
    if state is None:
        return ""
    if not state.done:
        return RACING_TEXT
    comparison = state.comparison
    speed = f"{comparison.speedup:.2f}×" if comparison and comparison.speedup else "–"
    load = f" Models ready in {load_seconds:.1f} s." if load_seconds > 1 else ""
    load += compile_note(state.settings.compile if state.settings is not None else None)
    if state.stop_reason is not None:
        return (
            f"Stopped ({state.stop_reason}): so far speculative decoding ran {speed} as fast as plain decoding "
            f"({state.plain.counters.new_tokens} and {state.spec.counters.new_tokens} tokens written).{load}"
        )
    return f"Done: speculative decoding ran {speed} as fast as plain decoding.{load}"


def view(state: RaceState, prepared: Prepared, final: bool) -> tuple:
    """The Run handler's outputs (see :data:`OUTPUTS`); charts and JSON only with the final state."""
    (plain_title, plain_sub), (spec_title, spec_sub) = pane_titles(state.settings)
    live = not final
    values = [
        pane_stats_html(state.plain, plain_title, plain_sub, live and not state.plain.finished),
        pane_html(state.plain),
        pane_stats_html(state.spec, spec_title, spec_sub, live and not state.spec.finished),
        pane_html(state.spec),
        speedup_html(state),
        figures_html(state),
        identical_html(state),
        status_text(state, prepared.load_seconds),
    ]
    if final:
        values += [
            race_frame(state),
            accepted_length_frame(state.spec.counters),
            acceptance_position_frame(state.spec.counters),
            result_dict(state, prepared.format_reason, prepared.calibration),
        ]
    else:
        values += [gr.skip(), gr.skip(), gr.skip(), gr.skip()]
    values.append(gr.skip())  # the cost curve: set once, when the race starts
    return tuple(values)


def starting_view(prepared: Prepared) -> tuple:
    """The first update of a race: empty panes, cleared charts, the machine's cost curve."""
    values = list(view(RaceState(race_settings(prepared)), prepared, final=False))
    for name in ("race_plot", "length_plot", "position_plot", "result"):
        values[OUTPUTS.index(name)] = None
    values[OUTPUTS.index("status")] = RACING_TEXT
    values[OUTPUTS.index("cost_plot")] = cost_plot_update(prepared)
    return tuple(values)


def run_inputs(values: Mapping[str, Any]) -> dict[str, Any]:
    """A Run's inputs by name as the request's: the draft-tokens choice as the draft length's schedule and count."""
    inputs = dict(values)
    inputs["num_draft_tokens_schedule"], inputs["num_draft_tokens"] = draft_length_of(inputs.pop("draft_tokens"))
    return inputs


def race_request(config: AppConfig, inputs: Mapping[str, Any]) -> RaceRequest:
    """The request behind a Run or a ``/race`` call, from its inputs by name (the API has no quantization: none);
    an empty pair or dtype means the app's default, as :func:`~specdemo.session.request.check_request` reads it."""
    return RaceRequest(**{**inputs, "pair": inputs.get("pair") or None, "dtype": inputs.get("dtype") or config.dtype})


def prepare(
    racer: Racer, request: RaceRequest, report: Progress | None = None, memory: SuffixMemory | None = None
) -> Prepared:
    """:meth:`Racer.prepare`, a refused request as a plain ``gr.Error``."""
    try:
        return racer.prepare(request, report, memory)
    except InputError as error:
        raise gr.Error(str(error), print_exception=False) from None


def race_updates(
    racer: Racer, prepared: Prepared, live: Callable[[RaceState], T], final: Callable[[RaceState], T],
    interval: float = 0.0,
) -> Iterator[T]:
    """One race as updates: ``live(state)`` at most every ``interval`` seconds while it runs, then ``final`` of its
    last state. A failure is one plain ``gr.Error``; closing this closes the race and both decoders."""
    states = racer.run(prepared)
    last = time.monotonic()
    state: RaceState | None = None
    try:
        for state in states:
            if state.done:
                break
            now = time.monotonic()
            if now - last >= interval:
                yield live(state)
                last = now
    except (RuntimeError, ValueError) as error:
        logger.exception("The race failed")
        raise gr.Error(f"the race failed: {first_line(error)}", print_exception=False) from None
    finally:
        states.close()  # on Stop or a cancelled call, Gradio closes the handler's generator, and this with it
    if state is not None:
        yield final(state)


def visitor_of(request: gr.Request | None) -> str:
    """Whose race it is: the visitor's Gradio session ("local" for a call without one: tests, embedding)."""
    return getattr(request, "session_hash", None) or "local"


def answer_of(result: Any) -> list[int] | None:
    """The answer a race's result (the ``/race`` JSON) leaves to remember: the speculative side's tokens, when it
    finished (EOS or the length limit) and the race was not stopped; None otherwise."""
    if not isinstance(result, dict) or result.get("stopped") or not isinstance(result.get("spec"), dict):
        return None
    spec = result["spec"]
    if spec.get("finish_reason") is None:
        return None
    return [int(token["id"]) for token in spec.get("tokens", ())]


class Handlers:
    """The app's event handlers, bound to one :class:`Racer` (tests drive these directly).

    :attr:`race` (the Run button) and :attr:`api` (the ``/race`` API) hold the GPU on ZeroGPU; the queue runs the
    validators before queueing, so bad input never waits. Each visitor has a memory of the answers of their earlier
    races (:class:`~specdemo.session.memories.SuffixMemories`), which the suffix mode drafts from: a race's answer
    is remembered once it has finished, in this process (on ZeroGPU a race runs in a worker process, whose changes
    would be lost), never while it runs.
    """

    def __init__(self, config: AppConfig) -> None:
        self.config = config
        self.racer = Racer(config)  # one for all the handlers: the queue runs one race at a time
        self.memories = SuffixMemories(HOSTED_MEMORY if config.hosted else LOCAL_MEMORY)
        result = OUTPUTS.index("result")
        self.race: Callable[..., Iterator[tuple]] = self._remembering(
            gpu(self.run_race, duration=config.gpu_duration), lambda update: update[result])
        self.api: Callable[..., Iterator[dict]] = self._remembering(
            gpu(self.api_race, duration=config.gpu_duration), lambda update: update)

    def _remembering(self, handler: Callable[..., Iterator[T]], result_of: Callable[[T], Any]
                     ) -> Callable[..., Iterator[T]]:
        """``handler``'s updates, passed on; once it has ended, the answer of its last update's result
        (``result_of``) remembered for the visitor who ran it."""
        signature = inspect.signature(handler)

        @functools.wraps(handler)
        def remembering(*args: Any, **kwargs: Any) -> Iterator[T]:
            visitor = visitor_of(signature.bind(*args, **kwargs).arguments.get("request"))
            updates = handler(*args, **kwargs)
            last = None
            try:
                for last in updates:
                    yield last
            finally:
                updates.close()
            answer = answer_of(result_of(last)) if last is not None else None
            if answer:
                self.memories.remember(visitor, answer)

        return remembering

    def memory_text(self, request: gr.Request | None = None) -> str:
        """What the visitor's memory holds, in words (the line under the mode)."""
        held = self.memories.describe(visitor_of(request))
        return (
            f"**Memory of earlier answers** (suffix mode drafts from it; yours alone): {held['answers']} of at most "
            f"{held['max_answers']} answers, {held['tokens']:,} of {held['max_tokens']:,} tokens."
        )

    def forget_memory(self, request: gr.Request | None = None) -> str:
        """Forget the visitor's earlier answers (the Forget button); the line under the mode, updated."""
        self.memories.forget(visitor_of(request))
        return self.memory_text(request)

    def drop_memory(self, request: gr.Request | None = None) -> None:
        """A visitor left (the page closed): drop their memory."""
        self.memories.drop(visitor_of(request))

    def run_race(
        self,
        prompt: str,
        pair: str,
        target: str,
        draft: str,
        mode: str,
        draft_tokens: str,
        max_new_tokens: float,
        temperature: float,
        top_p: float,
        seed: float,
        dtype: str,
        quantization: str,
        chat: bool,
        progress: gr.Progress = gr.Progress(),
        request: gr.Request | None = None,
    ) -> Iterator[tuple]:
        """One Run: load, then one race; yields the panes a few times a second and always the final state."""
        race = race_request(self.config, run_inputs(dict(
            prompt=prompt, pair=pair, target=target, draft=draft, mode=mode, draft_tokens=draft_tokens,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, dtype=dtype,
            quantization=quantization, chat=chat,
        )))

        def report(fraction: float, message: str) -> None:
            progress(max(0.0, min(1.0, fraction)), desc=message)

        prepared = prepare(self.racer, race, report, self.memories.get(visitor_of(request)))
        for warning in prepared.warnings:
            gr.Warning(warning)
        yield starting_view(prepared)
        yield from race_updates(
            self.racer, prepared,
            live=lambda state: view(state, prepared, final=False),
            final=lambda state: view(state, prepared, final=True),
            interval=self.config.update_interval,
        )

    def api_race(
        self,
        prompt: str,
        pair: str = "",
        mode: str = "draft",
        num_draft_tokens_schedule: str = "",
        num_draft_tokens: int | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        chat: bool = True,
        target: str = "",
        draft: str = "",
        dtype: str = "",
        request: gr.Request | None = None,
    ) -> Iterator[dict]:
        """Run one race to the end: a short progress object after every round, then the final texts, per-token
        kinds and figures as JSON (``client.predict`` returns that last one).

        ``num_draft_tokens_schedule``: "fixed", "adaptive" or "heuristic" (empty: fixed when ``num_draft_tokens``
        is given, else adaptive); ``num_draft_tokens``: fixed, the tokens drafted every round; adaptive or
        heuristic, the first round's (empty: the schedule's own start).

        Yielding every round lets the queue close the race within one round when the client cancels or
        disconnects, so the worker is free for the next visitor.
        """
        race = race_request(self.config, dict(
            prompt=prompt, pair=pair, mode=mode, num_draft_tokens_schedule=num_draft_tokens_schedule,
            num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            seed=seed, chat=chat, target=target, draft=draft, dtype=dtype,
        ))
        prepared = prepare(self.racer, race, memory=self.memories.get(visitor_of(request)))
        yield from race_updates(
            self.racer, prepared,
            live=progress_dict,
            final=lambda state: result_dict(state, prepared.format_reason, prepared.calibration),
        )

    def race_validator(self, *values: Any) -> list[dict]:
        """The Run's validator: its inputs in :data:`INPUTS` order."""
        return self.validation(race_request(self.config, run_inputs(dict(zip(INPUTS, values)))), INPUTS, RUN_ALIASES)

    def api_validator(self, *values: Any, **named: Any) -> list[dict]:
        """The ``/race`` API's validator: its inputs as :meth:`api_race` takes them, in order or by name."""
        inputs = inspect.signature(self.api_race).bind(*values, **named)
        inputs.apply_defaults()
        arguments = {name: value for name, value in inputs.arguments.items() if name in API_INPUTS}
        return self.validation(race_request(self.config, arguments), API_INPUTS)

    def validation(
        self, request: RaceRequest, names: Sequence[str], aliases: Mapping[str, str] | None = None
    ) -> list[dict]:
        """One ``gr.validate`` per input: the cheap checks of :meth:`Racer.check`, the message on the input at
        fault (``aliases``: the input that sets a request field of another name), or on the prompt."""
        try:
            self.racer.check(request)
        except InputError as error:
            log_refusal(str(error))
            field = (aliases or {}).get(error.field, error.field)
            blamed = field if field in names else names[0]
            return [gr.validate(name != blamed, str(error) if name == blamed else "") for name in names]
        return [gr.validate(True, "") for _ in names]


#: the ``/race`` API's inputs, in order: the parameters of :meth:`Handlers.api_race`, as clients see them
API_INPUTS = tuple(name for name in inspect.signature(Handlers.api_race).parameters if name not in ("self", "request"))


def make_handlers(config: AppConfig) -> Handlers:
    """The handlers of one app: one :class:`Racer` for all of them (the queue runs one race at a time)."""
    return Handlers(config)

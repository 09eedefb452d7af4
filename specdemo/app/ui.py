"""The Gradio page: one Run makes one fair race between plain and speculative decoding, every token coloured.

The app is a thin Gradio layer over the session (:mod:`specdemo.session`: requests, the racer, the results):

- :mod:`specdemo.app.config`: :class:`~specdemo.app.config.AppConfig`, what the app serves;
- :mod:`specdemo.app.handlers`: the Run button's handler, the ``/race`` API and the queue's validators;
- :mod:`specdemo.app.charts`: the charts' data frames; :mod:`specdemo.app.recorder`: the download row;
- here: :func:`build_app`, the Blocks page (layout, CSS/JS hooks, events), built in steps (the header, the race
  panel, the charts, the events) that pass the components around grouped in a :class:`Page`; :func:`preload`;
  :func:`launch` adds the page's CSS. Token spans, cards and CSS come from :mod:`specdemo.render.views` (no Gradio
  there).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import gradio as gr

from ..backends.loading import (
    LoadSettings,
    ModelLoadError,
    resolve_device,
    resolve_format,
)
from ..core.errors import InputError
from ..methods import METHODS
from ..render.views import (
    CSS,
    figures_html,
    identical_html,
    legend_html,
    pane_stats_html,
    pane_titles,
    speedup_html,
)
from ..session.calibration import PASS_LENGTHS, cached_format_choice
from ..session.request import DTYPES
from ..session.state import PaneState
from .charts import COST_COLOURS, SIDE_COLOURS
from .config import DRAFT_TOKENS_CHOICES, AppConfig, example_prompts
from .handlers import INPUTS, OUTPUTS, Handlers, make_handlers
from .recorder import RECORD_FILES, RECORD_LABELS, RECORD_VIDEOS, Recorder

logger = logging.getLogger(__name__)

# A stream update already on its way when Stop is pressed can land after the cancel and redraw a "running…" chip, so
# the page stays marked as stopped (until the next Run) and an observer re-marks whatever such a late update draws.
STOP_JS = (
    "() => { window.specdemoStopped = true; const mark = () => { "
    "document.querySelectorAll('.chip-running').forEach(c => "
    "{ c.textContent = 'stopped'; c.className = 'chip chip-idle'; }); "
    "document.querySelectorAll('#identical .badge-pending').forEach(b => { "
    "const text = 'stopped before the end: no comparison'; if (b.textContent !== text) b.textContent = text; }); }; "
    "window.specdemoMarkStopped = mark; mark(); if (!window.specdemoStopObserver) { window.specdemoStopObserver = new MutationObserver("
    "() => { if (window.specdemoStopped) window.specdemoMarkStopped(); }); "
    "window.specdemoStopObserver.observe(document.body, {childList: true, subtree: true}); } return []; }"
)
RUN_JS = "(...inputs) => { window.specdemoStopped = false; return inputs; }"  # runs before the race, inputs unchanged
STOPPED_TEXT = "Stopped: the race was cancelled; the panes show how far each side got."

SHOW_REJECTED_JS = "(show) => { document.body.classList.toggle('show-rejected', !!show); return []; }"

INTRO = """\
# ⚡ Speculative decoding race
Plain decoding (left) and speculative decoding (right) write **the same text with the same target model**, in
one fair race: the two decoders take turns, each timed only on its own work, so each pane fills at the speed it
would have alone. A small draft model (or an n-gram lookup in the prompt) proposes a few tokens; the target
checks them all in one forward pass and keeps the longest correct prefix plus one token of its own.
"""


def _pair_info(config: AppConfig, key: str) -> str:
    preset = config.presets.get(key)
    if preset is None:
        return ""
    memory = preset.resident_memory or "not measured yet (Hub models); see the hardware line"
    info = f"{preset.description}  \n*Hardware:* {preset.hardware}  \n*Measured memory:* {memory}"
    return f"{info}  \n*Target format:* {_format_note(config, preset.target)}"


def _format_note(config: AppConfig, target: str) -> str:
    """The format the target runs in here, as far as it is known before a race."""
    if config.dtype != "auto":
        return config.dtype
    try:
        device = resolve_device(config.device)
    except ModelLoadError:
        return "auto"
    if device.type != "cpu" or not config.calibrate:
        return f"auto ({resolve_format('auto', device)} on {device.type})"
    choice = cached_format_choice(target, LoadSettings(dtype="auto", device=config.device))
    if choice is None:
        return ("auto: w8a8, int8 or bfloat16, whichever decodes faster here where speculation can pay (measured at "
                "the first race)")
    return f"{choice.format} ({choice.reason})"


def mode_for_pair(config: AppConfig, key: str, current: str) -> str:
    """The mode a preset is meant for ("uag" for a pair with different tokenizers); keeps ``current`` otherwise,
    except that a same-tokenizer pair leaves the uag mode for draft mode."""
    preset = config.presets.get(key)
    if preset is None:
        return current
    if preset.mode == "uag":
        return "uag"
    return "draft" if current == "uag" else current


@dataclass
class SettingsControls:
    """The race's settings beside the prompt: the pair (with its description), the mode and the lengths."""

    pair: gr.Dropdown
    pair_info: gr.Markdown
    mode: gr.Dropdown
    draft_tokens: gr.Dropdown  # one choice for the draft length's schedule and count (see config.draft_length_of)
    max_new_tokens: gr.Slider
    memory: gr.Markdown  # what the visitor's memory of earlier answers holds (the suffix mode drafts from it)
    forget: gr.Button  # ... and the button that empties it


@dataclass
class MoreSettings:
    """The rarer settings, folded under "More settings": custom models, sampling, format, chat template."""

    target: gr.Textbox
    draft: gr.Textbox
    temperature: gr.Slider
    top_p: gr.Slider
    seed: gr.Number
    dtype: gr.Dropdown
    quantization: gr.Radio
    chat: gr.Checkbox


@dataclass
class Controls:
    """The page's inputs: the prompt, Run and Stop, and every setting of a race."""

    prompt: gr.Textbox
    run: gr.Button
    stop: gr.Button
    settings: SettingsControls
    more: MoreSettings

    def inputs(self) -> list[gr.components.Component]:
        """The Run handler's inputs, in :data:`~specdemo.app.handlers.INPUTS` order."""
        named = {"prompt": self.prompt, **vars(self.settings), **vars(self.more)}
        return [named[name] for name in INPUTS]


@dataclass
class RacePanel:
    """The race as it runs: the rejected-drafts switch, both panes with their stats, the figures, the status."""

    show_rejected: gr.Checkbox
    plain_stats: gr.HTML
    plain_output: gr.HTML
    spec_stats: gr.HTML
    spec_output: gr.HTML
    speedup: gr.HTML
    figures: gr.HTML
    identical: gr.HTML
    status: gr.Markdown


@dataclass
class Charts:
    """The charts drawn after a run, and the machine's cost curve drawn when a race starts."""

    race_plot: gr.LinePlot
    length_plot: gr.BarPlot
    position_plot: gr.BarPlot
    cost_plot: gr.BarPlot


@dataclass
class Page:
    """Every component an event reads or writes."""

    controls: Controls
    panel: RacePanel
    downloads: dict[str, gr.DownloadButton]  # by kind, see :data:`~specdemo.app.recorder.RECORD_LABELS`
    video_preview: gr.Video
    charts: Charts
    result: gr.JSON

    def outputs(self) -> list[gr.components.Component]:
        """The Run handler's outputs, in :data:`~specdemo.app.handlers.OUTPUTS` order."""
        named = {**vars(self.panel), **vars(self.charts), "result": self.result}
        return [named[name] for name in OUTPUTS]


def build_app(config: AppConfig | None = None) -> gr.Blocks:
    """The whole page: controls, the two panes, the run figures, the charts and the ``/race`` API."""
    config = config or AppConfig()
    handlers = make_handlers(config)
    with gr.Blocks(title=config.title, analytics_enabled=False) as demo:
        page = _page(config)
        recorder, run_event = _wire_run(page, handlers)
        _wire_memory(demo, page, handlers, run_event)
        _wire_settings(page, config)
        api = gr.api(handlers.api, api_name="race", concurrency_limit=1, concurrency_id="device")
        demo.fns[api["id"]].validator = handlers.api_validator  # gr.api takes no validator argument (Gradio 6)
    demo.queue(max_size=config.max_queue, default_concurrency_limit=1)
    demo.specdemo_handlers = handlers  # for tests and embedding
    demo.specdemo_recorder = recorder
    return demo


def _page(config: AppConfig) -> Page:
    """The layout, top to bottom: the header, the race, its recording, the charts, its JSON."""
    controls = _header(config)
    panel = _race_panel()
    with gr.Accordion("Recording of the race (after a run)", open=True):
        with gr.Row(equal_height=True):
            downloads = {
                kind: gr.DownloadButton(RECORD_LABELS[kind], interactive=False, elem_id=f"download-{kind}")
                for kind in RECORD_FILES + RECORD_VIDEOS
            }
        video_preview = gr.Video(label="The race as a video (MP4)", interactive=False, format="mp4", height=400,
                                 elem_id="video-preview")
    charts = _charts()
    with gr.Accordion("Run data (JSON, as the /race API returns it)", open=False):
        result = gr.JSON(elem_id="result")
    return Page(controls, panel, downloads, video_preview, charts, result)


def _header(config: AppConfig) -> Controls:
    """The intro, the prompt with Run and Stop beside the main settings, "More settings", the examples."""
    gr.Markdown(INTRO)
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            prompt = gr.Textbox(
                label="Prompt",
                placeholder="Type a prompt, or pick an example below",
                lines=6,
                max_lines=14,
                elem_id="prompt",
            )
            with gr.Row():
                run = gr.Button("Run the race", variant="primary", elem_id="run", scale=3)
                stop = gr.Button("Stop", variant="stop", elem_id="stop", scale=1)
        with gr.Column(scale=2):
            settings = _settings(config)
    with gr.Accordion("More settings", open=False):
        more = _more_settings(config)
    examples = example_prompts(config)
    if examples:
        gr.Examples(
            examples=[[text] for _, text in examples],
            inputs=[prompt],
            example_labels=[label for label, _ in examples],
            cache_examples=False,
            label="Examples",
        )
    return Controls(prompt, run, stop, settings, more)


def _settings(config: AppConfig) -> SettingsControls:
    """The pair, its description, the mode, the draft tokens per round and the max new tokens."""
    default_pair = config.default_pair()
    pair = gr.Dropdown(
        choices=[(p.label, p.key) for p in config.presets.values()],
        value=default_pair,
        label="Target + draft pair",
        elem_id="pair",
    )
    pair_info = gr.Markdown(_pair_info(config, default_pair), elem_id="pair-info")
    with gr.Row():
        mode = gr.Dropdown(
            choices=[(method.label, name) for name, method in METHODS.items()],
            value=next(iter(METHODS)),
            label="Speculative mode",
            elem_id="mode",
        )
        draft_tokens = gr.Dropdown(
            choices=[("adaptive (cost-aware)", "adaptive"), ("heuristic (+2/−1)", "heuristic")]
            + [(k, k) for k in DRAFT_TOKENS_CHOICES[2:]],
            value=config.draft_tokens if config.draft_tokens in DRAFT_TOKENS_CHOICES else "adaptive",
            label="Draft tokens per round",
            elem_id="draft-tokens",
        )
    max_new_tokens = gr.Slider(
        1,
        config.max_new_tokens_limit,
        value=config.max_new_tokens,
        step=1,
        label="Max new tokens",
        elem_id="max-new-tokens",
    )
    with gr.Row(equal_height=True):
        memory = gr.Markdown(elem_id="memory")
        forget = gr.Button("Forget earlier answers", size="sm", scale=0, elem_id="forget")
    return SettingsControls(pair, pair_info, mode, draft_tokens, max_new_tokens, memory, forget)


def _more_settings(config: AppConfig) -> MoreSettings:
    """The custom target and draft (when the app allows them), sampling, the target's format, the chat template."""
    with gr.Row(visible=config.custom_models):
        target = gr.Textbox(
            label="Custom target (Hub id or offline:NAME)" if config.hosted and not config.model_roots
            else "Custom target (Hub id, local folder, .gguf or offline:NAME)",
            placeholder="empty: the pair's target",
            visible=config.custom_models,
            elem_id="custom-target",
        )
        draft = gr.Textbox(
            label="Custom draft (must share the target's tokenizer)",
            placeholder="empty: the pair's draft",
            visible=config.custom_models,
            elem_id="custom-draft",
        )
    with gr.Row():
        temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)")
        top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p")
        seed = gr.Number(value=0, precision=0, label="Seed")
    quant_reason = config.quantization_unavailable()
    with gr.Row():
        dtype = gr.Dropdown(
            choices=list(DTYPES), value=config.dtype if config.dtype in DTYPES else "auto", label="dtype"
        )
        quantization = gr.Radio(
            choices=[("none", "none"), ("8-bit", "8bit"), ("4-bit", "4bit")],
            value="none",
            label="Target quantization",
            info=quant_reason or "bitsandbytes, target only",
            interactive=quant_reason is None,
            elem_id="quantization",
        )
        chat = gr.Checkbox(value=True, label="Chat template", info="wrap the prompt as one user turn")
    return MoreSettings(target, draft, temperature, top_p, seed, dtype, quantization, chat)


def _pane(side: str, title: str, sub: str) -> tuple[gr.HTML, gr.HTML]:
    """One side's column: its stats above the box its tokens stream into."""
    with gr.Column():
        stats = gr.HTML(pane_stats_html(PaneState(side), title, sub, running=False), elem_id=f"{side}-stats")
        output = gr.HTML("", html_template="<div class='tok-box'>${value}</div>", elem_id=f"{side}-output",
                         max_height=520, autoscroll=True)
    return stats, output


def _race_panel() -> RacePanel:
    """The legend with the rejected-drafts switch, the two panes under their stats, the figures, the status."""
    (plain_title, plain_sub), (spec_title, spec_sub) = pane_titles(None)
    with gr.Row(equal_height=True):
        gr.HTML(legend_html(), elem_id="legend")
        show_rejected = gr.Checkbox(value=False, label="Show rejected drafts (struck through)", scale=0,
                                    min_width=260, elem_id="show-rejected")
    with gr.Row(equal_height=False):
        plain_stats, plain_output = _pane("plain", plain_title, plain_sub)
        spec_stats, spec_output = _pane("spec", spec_title, spec_sub)
    with gr.Row(equal_height=True):
        with gr.Column(scale=1, min_width=200):
            speedup = gr.HTML(speedup_html(None), elem_id="speedup")
        with gr.Column(scale=2, min_width=380):
            figures = gr.HTML(figures_html(None), elem_id="figures")
        with gr.Column(scale=1, min_width=200):
            identical = gr.HTML(identical_html(None), elem_id="identical")
    status = gr.Markdown("", elem_id="status")
    return RacePanel(show_rejected, plain_stats, plain_output, spec_stats, spec_output, speedup, figures, identical,
                     status)


def _charts() -> Charts:
    """The "Charts" fold: the race, tokens per pass, acceptance by position; the cost curve (hidden until known)."""
    with gr.Accordion("Charts (after a run)", open=True):
        with gr.Row():
            race_plot = gr.LinePlot(
                x="seconds",
                y="tokens",
                color="side",
                color_map=SIDE_COLOURS,
                title="The race: tokens over own compute time",
                x_title="seconds of own compute",
                y_title="tokens",
                elem_id="race-plot",
            )
            length_plot = gr.BarPlot(
                x="tokens per pass",
                y="rounds",
                title="Tokens per target pass (histogram)",
                sort=[str(k) for k in range(1, 65)],
                elem_id="length-plot",
            )
            position_plot = gr.BarPlot(
                x="draft position",
                y="acceptance rate",
                title="Acceptance by draft position (Medusa: head k drafts position k)",
                y_lim=[0, 1],
                sort=[str(k) for k in range(1, 65)],
                elem_id="position-plot",
            )
        cost_plot = gr.BarPlot(
            x="tokens in the pass",
            y="cost (one-token passes)",
            color="speculation",
            color_map=COST_COLOURS,
            tooltip="all",
            title="On this machine a pass over k tokens costs this much of a one-token pass",
            sort=[str(k) for k in PASS_LENGTHS],
            visible=False,
            elem_id="cost-plot",
        )
    return Charts(race_plot, length_plot, position_plot, cost_plot)


def _wire_run(page: Page, handlers: Handlers) -> tuple[Recorder, Any]:
    """Run (the race, then its recordings) and Stop; returns the recorder of the download row and the race's
    event."""
    run, downloads, video_preview = page.controls.run, page.downloads, page.video_preview
    run_event = run.click(
        handlers.race,
        inputs=page.controls.inputs(),
        outputs=page.outputs(),
        concurrency_limit=1,
        concurrency_id="device",
        api_visibility="undocumented",
        api_name="race_stream",
        show_progress="minimal",
        validator=handlers.race_validator,
        js=RUN_JS,
    )
    # recordings: only once the race has ended, on the device's queue so that no race runs meanwhile
    recorder = Recorder()
    run.click(Recorder.clear, outputs=[*downloads.values(), video_preview], queue=False, api_visibility="private")
    run_event.success(
        recorder.files,
        inputs=page.result,
        outputs=[downloads[kind] for kind in RECORD_FILES],
        concurrency_limit=1,
        concurrency_id="device",
        api_visibility="private",
        show_progress="hidden",
    ).success(
        recorder.videos,
        inputs=page.result,
        outputs=[*(downloads[kind] for kind in RECORD_VIDEOS), video_preview],
        concurrency_limit=1,
        concurrency_id="device",
        api_visibility="private",
        show_progress="minimal",
    )
    # the status after the cancel, so that it comes after the race's last update
    page.controls.stop.click(fn=None, cancels=[run_event], js=STOP_JS).then(
        lambda: STOPPED_TEXT, outputs=page.panel.status, queue=False, api_visibility="private"
    )
    return recorder, run_event


def _wire_memory(demo: gr.Blocks, page: Page, handlers: Handlers, run_event: Any) -> None:
    """The visitor's memory of earlier answers: shown when the page loads and after every race, emptied by its
    button, dropped when the page closes."""
    settings = page.controls.settings
    private = {"queue": False, "api_visibility": "private", "show_progress": "hidden"}
    run_event.then(handlers.memory_text, outputs=settings.memory, **private)
    settings.forget.click(handlers.forget_memory, outputs=settings.memory, **private)
    demo.load(handlers.memory_text, outputs=settings.memory, **private)
    demo.unload(handlers.drop_memory)


def _wire_settings(page: Page, config: AppConfig) -> None:
    """A new pair shows its description and picks its mode; the switch shows or hides the rejected drafts."""
    settings = page.controls.settings
    pair, mode = settings.pair, settings.mode
    pair.change(lambda key: _pair_info(config, key), inputs=pair, outputs=settings.pair_info, queue=False,
                api_visibility="private")
    pair.change(lambda key, current: mode_for_pair(config, key, current), inputs=[pair, mode], outputs=mode,
                queue=False, api_visibility="private")
    page.panel.show_rejected.change(fn=None, inputs=page.panel.show_rejected, js=SHOW_REJECTED_JS)


def preload(demo: gr.Blocks) -> None:
    """Load the default pair now (ZeroGPU Spaces want models loaded before serving); failures only log."""
    racer = demo.specdemo_handlers.racer
    try:
        racer.preload()
    except InputError as error:
        logger.warning("Preloading %s failed: %s", racer.config.default_pair(), error)


def launch(demo: gr.Blocks, **kwargs: Any) -> Any:
    """``demo.launch`` with the page's CSS (Gradio 6 takes CSS at launch)."""
    kwargs.setdefault("css", CSS)
    kwargs.setdefault("footer_links", ["api", "gradio"])
    return demo.launch(**kwargs)

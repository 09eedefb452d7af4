"""What the app, the HTML replay and the video draw, without Gradio: token spans, figures, titles, CSS.

- HTML views of a :class:`~specdemo.session.state.RaceState`: :func:`render_token` (a token span coloured by kind,
  probabilities in its hover title), :func:`pane_html`, :func:`legend_html`, :func:`pane_stats_html`,
  :func:`speedup_html`, :func:`figures_html`, :func:`identical_html` and :data:`CSS`, the stylesheet they need (its
  token colours are :data:`KIND_COLOURS`, which the video uses too);
- text: :func:`pane_titles`, and :func:`race_title` / :func:`race_details`, the lines that name a race.
"""

from __future__ import annotations

import html
from typing import Iterable

from ..core.events import (
    ACCEPTED,
    BONUS,
    CORRECTED,
    DRAFTED_BY_BOTH,
    DRAFTED_BY_HEAD,
    DRAFTED_BY_LOOKUP,
    DRAFTED_FROM_OUTPUT,
    DRAFTED_FROM_PROMPT,
    EARLIER_ANSWER,
    PLAIN,
    REJECTED,
    Counters,
    TokenEvent,
    answer_number,
)
from ..session.racelog import RaceSettings
from ..session.state import PaneState, RaceState

KIND_LABELS = {
    ACCEPTED: "accepted draft token",
    CORRECTED: "corrected by the target",
    BONUS: "bonus token (every draft accepted)",
    PLAIN: "plain token (target alone)",
    REJECTED: "rejected draft token",
}
#: (background, text) colour of each token kind: the CSS, the replay and the video draw with these
KIND_COLOURS = {
    ACCEPTED: ("#bbf7d0", "#14532d"),
    CORRECTED: ("#fed7aa", "#7c2d12"),
    BONUS: ("#bfdbfe", "#1e3a8a"),
    PLAIN: ("#f3f4f6", "#1f2937"),
    REJECTED: ("#fecaca", "#991b1b"),
}
#: margin (top-1 minus top-2 logit) below which a divergence counts as a low-precision near-tie
NEAR_TIE_MARGIN = 0.5


# ----------------------------------------------------------------------------------------------------------------
# views (pure functions)


def _fmt_prob(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


#: who drafted a token, in words (drafters with several parts: EAGLE's head and its prompt-lookup branch; suffix
#: decoding's trees over the prompt, the output so far and earlier answers)
SOURCE_LABELS = {
    DRAFTED_BY_HEAD: "drafted by the head",
    DRAFTED_BY_LOOKUP: "drafted by prompt lookup",
    DRAFTED_BY_BOTH: "drafted by the head and prompt lookup",
    DRAFTED_FROM_PROMPT: "drafted from the prompt",
    DRAFTED_FROM_OUTPUT: "drafted from this answer so far",
    EARLIER_ANSWER: "drafted from an earlier answer",
}


def source_label(source: str) -> str:
    """Who drafted a token, in words; an earlier answer by its number (the visitor's own races, counted from 1)."""
    number = answer_number(source)
    if number is not None:
        return f"drafted from earlier answer {number}"
    return SOURCE_LABELS.get(source, f"drafted by {source}")


def token_title(token: TokenEvent) -> str:
    """The hover text of a token: its round, how it was made (and by which part of the drafter), and the
    probabilities behind it."""
    parts = [f"round {token.round}", KIND_LABELS.get(token.kind, token.kind)]
    if token.source is not None:
        parts.append(source_label(token.source))
    if token.draft_prob is not None:
        parts.append(f"draft p = {_fmt_prob(token.draft_prob)}")
    if token.target_prob is not None:
        parts.append(f"target p = {_fmt_prob(token.target_prob)}")
    return " · ".join(parts)


def render_token(token: TokenEvent) -> str:
    """One token as an HTML span coloured by kind; its text is escaped (whitespace is kept by the CSS)."""
    kind = token.kind if token.kind in KIND_LABELS else PLAIN
    return (
        f'<span class="tok tok-{kind}" title="{html.escape(token_title(token), quote=True)}">'
        f"{html.escape(token.text, quote=True)}</span>"
    )


def render_tokens(tokens: Iterable[TokenEvent]) -> str:
    """Tokens as consecutive coloured spans."""
    return "".join(render_token(token) for token in tokens)


def pane_html(pane: PaneState) -> str:
    """A pane's tokens as shown: accepted drafts, rejected drafts (struck through, hidden unless asked for), the
    target's own tokens."""
    return render_tokens(pane.shown)


def legend_html() -> str:
    items = [
        (ACCEPTED, "accepted draft token"),
        (CORRECTED, "corrected by the target"),
        (BONUS, "bonus token (all drafts accepted)"),
        (PLAIN, "plain (target alone)"),
        (REJECTED, "rejected draft (when shown)"),
    ]
    spans = "".join(
        f'<span class="legend-item"><span class="tok tok-{kind} legend-swatch">{html.escape(label)}</span></span>'
        for kind, label in items
    )
    return f'<div class="legend">{spans}</div>'


def _rate(counters: Counters) -> float | None:
    seconds = counters.seconds
    return counters.new_tokens / seconds if seconds > 0 and counters.new_tokens else None


def _stat(value: str, label: str) -> str:
    return f'<span class="stat"><b>{html.escape(value)}</b> {html.escape(label)}</span>'


def pane_stats_html(pane: PaneState, title: str, subtitle: str, running: bool) -> str:
    """A pane's header with its live figures: tokens/s, own compute time, target passes, tokens."""
    counters = pane.counters
    rate = _rate(counters)
    stats = [
        _stat(f"{rate:.2f}" if rate else "–", "tok/s"),
        _stat(f"{counters.seconds:.2f} s", "elapsed"),
        _stat(str(counters.target_passes), "target passes"),
        _stat(str(counters.new_tokens), "tokens"),
    ]
    if pane.side == "spec" and counters.drafted:
        stats.append(_stat(f"{counters.accepted}/{counters.drafted}", "drafts accepted"))
    if pane.finished:
        chip = f'<span class="chip chip-done">done ({html.escape(pane.finish_reason or "")})</span>'
    elif running:
        chip = '<span class="chip chip-running">running…</span>'
    else:
        chip = '<span class="chip chip-idle">stopped</span>' if counters.new_tokens else ""
    return (
        f'<div class="pane-head"><div class="pane-title">{html.escape(title)} {chip}</div>'
        f'<div class="pane-sub">{html.escape(subtitle)}</div>'
        f'<div class="pane-stats">{"".join(stats)}</div></div>'
    )


def live_speedup(state: RaceState) -> float | None:
    plain, spec = _rate(state.plain.counters), _rate(state.spec.counters)
    return spec / plain if plain and spec else None


def speedup_html(state: RaceState | None) -> str:
    """The headline figure: speculative tokens/s over plain tokens/s, each on its own compute time."""
    if state is None:
        return _card("–", "speedup", "tokens/s, speculative ÷ plain", "fig-main")
    if state.done:
        comparison = state.comparison
        value = comparison.speedup if comparison else None
        note = "tokens/s, speculative ÷ plain (own compute time)"
        if comparison is not None and comparison.decode_speedup and comparison.prefill_share is not None:
            note += (
                f"; after the prompt pass ({comparison.prefill_share:.0%} of plain's time, the same on both sides): "
                f"{comparison.decode_speedup:.2f}×"
            )
    else:
        value = live_speedup(state)
        note = "so far (race running)"
    text = f"{value:.2f}×" if value else "–"
    extra = " fig-good" if value and value >= 1.0 and state.done else (" fig-bad" if value and state.done else "")
    return _card(text, "speedup", note, "fig-main" + extra)


def _card(value: str, label: str, note: str = "", classes: str = "") -> str:
    note_html = f'<div class="fig-note">{html.escape(note)}</div>' if note else ""
    return (
        f'<div class="fig {classes}"><div class="fig-value">{html.escape(value)}</div>'
        f'<div class="fig-label">{html.escape(label)}</div>{note_html}</div>'
    )


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def figures_html(state: RaceState | None) -> str:
    """Acceptance rate, mean accepted length and the expected speedup for the measured acceptance and cost."""
    if state is None or not state.spec.counters.new_tokens:
        cards = [_card("–", "acceptance rate"), _card("–", "mean accepted length"), _card("–", "expected speedup")]
        return f'<div class="figs">{"".join(cards)}</div>'
    spec = state.spec.metrics()
    counters = state.spec.counters
    cards = [
        _card(_pct(spec.acceptance_rate), "acceptance rate", f"{counters.accepted} of {counters.drafted} drafts"),
        _card(
            "–" if spec.mean_accepted_length is None else f"{spec.mean_accepted_length:.2f}",
            "mean accepted length",
            "tokens per target pass (plain: 1)",
        ),
    ]
    comparison = state.comparison if state.plain.counters.rounds else None
    if comparison is not None and comparison.expected_speedup is not None:
        detail = (
            f"E {spec.expected_tokens_per_round or 1:.2f} tokens/pass, α {spec.alpha or 0:.2f}, "
            f"γ {spec.mean_draft_length or 0:.1f}, c {comparison.draft_cost or 0:.2f}, "
            f"v {comparison.verify_cost or 0:.2f}"
        )
        if state.done and comparison.fraction_of_expected is not None:
            detail += f"; measured {comparison.fraction_of_expected:.0%} of it"
        cards.append(_card(f"{comparison.expected_speedup:.2f}×", "expected speedup", detail))
    else:
        cards.append(_card("–", "expected speedup"))
    return f'<div class="figs">{"".join(cards)}</div>'


def identical_html(state: RaceState | None) -> str:
    """The "identical output" badge, or where and why the outputs parted."""
    if state is None or not state.done:
        text = "comparing when both finish…" if state is not None else "identical output?"
        return f'<div class="badge badge-pending">{html.escape(text)}</div>'
    if state.divergence is None and state.stop_reason is not None:
        compared = min(len(state.plain.tokens), len(state.spec.tokens))
        return (
            f'<div class="badge badge-same" title="the race stopped early; both outputs agree as far as both got">'
            f"✓ identical so far ({compared} tokens; stopped: {html.escape(state.stop_reason)})</div>"
        )
    if state.divergence is None:
        return (
            f'<div class="badge badge-same" title="speculative output equals plain output token for token">'
            f"✓ identical output ({len(state.plain.ids)} tokens)</div>"
        )
    position = state.divergence
    if not state.greedy:
        return (
            f'<div class="badge badge-info">sampled: the texts part at token {position + 1} '
            f"(same distribution, different draws)</div>"
        )
    if state.margin is not None and state.margin < NEAR_TIE_MARGIN:
        dtype = state.settings.dtype if state.settings else "low precision"
        return (
            f'<div class="badge badge-tie" title="the target\'s two best tokens were nearly tied here; a k-token '
            f'verify pass and a one-token pass round differently in {html.escape(dtype)}">'
            f"≈ outputs part at token {position + 1}: {html.escape(dtype)} near-tie "
            f"(logit margin {state.margin:.3f})</div>"
        )
    margin = f" (logit margin {state.margin:.3f})" if state.margin is not None else ""
    return f'<div class="badge badge-diff">≠ outputs differ at token {position + 1}{html.escape(margin)}</div>'


def pane_titles(settings: RaceSettings | None) -> tuple[tuple[str, str], tuple[str, str]]:
    """(title, subtitle) of the plain and the speculative pane."""
    if settings is None:
        return ("Plain decoding", "the target alone: one forward pass per token"), (
            "Speculative decoding",
            "drafts proposed, verified by the target in one pass",
        )
    helper = f"draft {settings.draft}" if settings.draft else settings.method_label
    return (
        ("Plain decoding", f"target {settings.target}, one pass per token"),
        (f"Speculative decoding ({settings.mode})", f"target {settings.target} + {helper}"),
    )

def race_title(settings: RaceSettings) -> str:
    """One line naming the race: the pair (or the target and its helper), the mode and the hardware."""
    helper = settings.draft or settings.method_label or settings.mode
    pair = f"{settings.pair}: " if settings.pair else ""
    return f"{pair}{settings.target} + {helper} · {settings.mode} mode · {settings.hardware}"


def draft_length_text(settings: RaceSettings) -> str:
    """The draft length raced, in words: "4" (fixed), "adaptive (≤ 12)", "heuristic from 3 (≤ 12)"."""
    if settings.num_draft_tokens_schedule == "fixed":
        return str(settings.num_draft_tokens)
    start = "" if settings.num_draft_tokens is None else f" from {settings.num_draft_tokens}"
    cap = "" if settings.max_num_draft_tokens is None else f" (≤ {settings.max_num_draft_tokens})"
    return f"{settings.num_draft_tokens_schedule}{start}{cap}"


def race_details(settings: RaceSettings) -> str:
    """The settings behind the race, in one line."""
    sampling = "greedy" if settings.greedy else f"temperature {settings.temperature:g}, top-p {settings.top_p:g}"
    seed = f", seed {settings.seed}" if settings.seed is not None and not settings.greedy else ""
    return (
        f"{settings.max_new_tokens} new tokens max · draft tokens {draft_length_text(settings)} · {sampling}{seed} · "
        f"{settings.dtype} on {settings.device} · prompt {settings.prompt_tokens} tokens"
    )


CSS = (
    """
.tok-box { white-space: pre-wrap; word-break: break-word; overflow-wrap: anywhere;
  font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", monospace;
  font-size: 13.5px; line-height: 1.6; background: #ffffff; color: #1f2937;
  border: 1px solid #e5e7eb; border-radius: 8px; padding: 10px 12px; min-height: 300px; }
.tok { border-radius: 3px; }
"""
    + "".join(
        f".tok-{kind} {{ background: {background}; color: {text}; }}\n"
        for kind, (background, text) in KIND_COLOURS.items()
    )
    + """.tok-rejected { display: none; text-decoration: line-through; }
body.show-rejected .tok-rejected, .legend .tok-rejected { display: inline !important; }
.tok:hover { outline: 1px solid #6b7280; }
.legend { display: flex; flex-wrap: wrap; gap: 6px 14px; align-items: center; font-size: 13px; padding: 4px 0; }
.legend-swatch { padding: 2px 6px; font-family: inherit; }
.pane-head { padding: 2px 2px 6px 2px; }
.pane-title { font-weight: 700; font-size: 16px; }
.pane-sub { font-size: 12px; color: #6b7280; margin: 1px 0 4px 0; }
.pane-stats { display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 13px; }
.pane-stats b { font-variant-numeric: tabular-nums; }
.chip { font-size: 11px; font-weight: 600; padding: 1px 8px; border-radius: 999px; margin-left: 6px;
  vertical-align: middle; }
.chip-running { background: #fef3c7; color: #92400e; }
.chip-done { background: #dcfce7; color: #166534; }
.chip-idle { background: #e5e7eb; color: #374151; }
.figs { display: flex; gap: 10px; flex-wrap: wrap; }
.fig { flex: 1 1 120px; border: 1px solid #e5e7eb; border-radius: 8px; padding: 8px 12px; background: #ffffff;
  color: #111827; min-width: 120px; }
.fig-value { font-size: 24px; font-weight: 700; font-variant-numeric: tabular-nums; }
.fig-main .fig-value { font-size: 34px; }
.fig-good { border-color: #16a34a; background: #f0fdf4; }
.fig-bad { border-color: #dc2626; background: #fef2f2; }
.fig-label { font-size: 13px; font-weight: 600; color: #374151; }
.fig-note { font-size: 11.5px; color: #6b7280; }
.badge { display: inline-block; border-radius: 8px; padding: 14px 14px; font-weight: 600; font-size: 15px;
  width: 100%; box-sizing: border-box; }
.badge-same { background: #dcfce7; color: #166534; border: 1px solid #16a34a; }
.badge-tie { background: #fef3c7; color: #92400e; border: 1px solid #d97706; }
.badge-diff { background: #fee2e2; color: #991b1b; border: 1px solid #dc2626; }
.badge-info { background: #e0f2fe; color: #075985; border: 1px solid #0284c7; }
.badge-pending { background: #f3f4f6; color: #6b7280; border: 1px dashed #9ca3af; font-weight: 500; }
#run { min-height: 44px; }
"""
)


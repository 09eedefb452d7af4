"""Prompts for self-distilled Medusa training, built offline from the Python standard library and a few word lists.

The target answers these prompts itself (``medusa_train``), so the heads learn to guess the target's own way of
writing chat answers: explanations, code, edits, summaries, translations, worked arithmetic, short pieces of
writing. The material is the standard library's functions and docstrings and the language reference's prose
(``pydoc_data``); the word lists below are the project's own. The benchmark prompt files are never read.

:func:`training_prompts` draws its prompts in one seeded sequence, so a set of another size is another set.
:func:`chat_prompts` (the EAGLE trainer's ``--chat-answers``) makes prompt i from the seed and i alone: advice,
explanations, extraction from a made-up text, humanities, lists, arithmetic, plans, logic puzzles, rewriting in a
tone, role play, STEM and writing, so that a larger set extends a smaller one and its answers can be reused.
:func:`passage_prompts` (``--passage-answers``) quotes the target's answer to chat prompt i in prompt i and asks
for a summary, a translation, an answer to a question over it or an extraction from it: answers that transform a
text the prompt gives, as summarization, translation and retrieval questions do.
"""

from __future__ import annotations

import ast
import random
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

#: subjects for explanations, opinions and advice
SUBJECTS = [
    "recursion", "hash tables", "binary search", "public-key cryptography", "garbage collection", "photosynthesis",
    "compound interest", "the water cycle", "plate tectonics", "vaccines", "inflation", "supply and demand",
    "the French Revolution", "black holes", "machine learning", "version control", "unit testing", "climate change",
    "the immune system", "renewable energy", "electric cars", "remote work", "the printing press", "DNA replication",
    "neural networks", "the stock market", "sleep", "meditation", "volcanoes", "the Roman Empire", "quantum computing",
    "database indexes", "caching", "HTTP", "time zones", "floating-point numbers", "Unicode", "regular expressions",
    "the theory of evolution", "antibiotics", "coral reefs", "the Renaissance", "jazz", "chess openings",
    "marathon training", "composting", "bread baking", "budgeting", "public speaking", "learning a new language",
]
#: short pieces of writing: (kind, subject)
WRITING = [
    "a short poem about {}", "a short story about {}", "a haiku about {}", "a product description for {}",
    "a persuasive paragraph about {}", "a friendly email inviting colleagues to a talk on {}",
    "a limerick about {}", "a diary entry from someone discovering {}", "a news headline and lead paragraph about {}",
]
THINGS = [
    "a lighthouse keeper", "a lost umbrella", "the first day of spring", "a robot learning to paint", "an old library",
    "a city at night", "a cup of coffee", "a mountain village", "a stubborn cat", "a long train journey",
    "a forgotten password", "the ocean", "a kitchen garden", "a school reunion", "a snowy morning", "a street market",
]
QUESTION_TEMPLATES = [
    "Explain {} to a beginner.", "What are the main advantages and disadvantages of {}?",
    "Give me five practical tips about {}.", "How would you teach {} to a ten-year-old?",
    "What are common misconceptions about {}?", "Write a short FAQ about {} with three questions and answers.",
    "Compare {} and {} in a few paragraphs.", "Why does {} matter today? Answer in one paragraph.",
]
CODE_EDITS = [
    "Add type hints and a docstring to this function:", "Rewrite this function to be easier to read:",
    "Write unit tests with pytest for this function:", "Explain what this Python code does, step by step:",
    "Find possible bugs or edge cases in this function and suggest fixes:", "Translate this Python function into JavaScript:",
    "Rewrite this function without changing its behaviour, using more descriptive names:",
    "Add logging and error handling to this function:",
]
LANGUAGES = ["French", "German", "Spanish", "Italian", "Chinese", "Japanese", "Portuguese"]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo"]
ITEMS = ["apples", "books", "tickets", "pencils", "boxes of tea", "plants", "notebooks", "loaves of bread"]


@dataclass(frozen=True)
class TrainingPrompt:
    kind: str
    text: str


def documented_functions(path: Path) -> Iterator[tuple[str, str]]:
    """(source, first docstring sentence) of each public function of 4 to 30 lines in ``path`` whose docstring's
    first sentence is 20 to 160 characters long, in the order ``ast.walk`` meets them (none for a file that does not
    parse)."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        source = ast.get_source_segment(text, node, padded=True)
        if not doc or not source or not 4 <= source.count("\n") <= 30:
            continue
        sentence = doc.strip().split("\n\n")[0].replace("\n", " ").split(". ")[0].strip().rstrip(".")
        if 20 <= len(sentence) <= 160:
            yield textwrap.dedent(source), sentence


def _functions(files: list[Path], rng: random.Random, limit: int) -> list[tuple[str, str]]:
    """(source, first docstring sentence) of standard-library functions of 4 to 30 lines with a docstring."""
    found: list[tuple[str, str]] = []
    shuffled = list(files)
    rng.shuffle(shuffled)
    for path in shuffled:
        if len(found) >= limit:
            break
        first = next(documented_functions(path), None)  # one function per file keeps the mix broad
        if first is not None:
            found.append(first)
    return found


def _paragraphs() -> list[str]:
    """Prose paragraphs (no grammar or code blocks) of the language reference shipped in ``pydoc_data``."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a trimmed Python without pydoc_data
        return []
    paragraphs = []
    for name in sorted(topics):
        for block in topics[name].split("\n\n"):
            if block.startswith((" ", "*", "=")) or "::=" in block or len(block) < 200:
                continue
            paragraphs.append(" ".join(block.split()))
    return paragraphs


def _word_problem(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b, c = rng.randint(3, 40), rng.randint(2, 12), rng.randint(2, 9)
    templates = [
        f"{name} buys {a} {item} at {b} dollars each and pays with a {100 * (a * b // 100 + 1)} dollar bill. "
        "How much change does {name} get? Explain your steps.",
        f"{name} has {a} {item}. {other} has {b} times as many. They give away {c} each. How many do they have "
        "together now? Solve step by step.",
        f"A train travels {a * 10} km in {b} hours. At the same speed, how far does it go in {b + c} hours? "
        "Show your reasoning.",
        f"{name} saves {b} dollars a week and already has {a} dollars. How many weeks until {name} has "
        f"{a + b * (c + 5)} dollars? Explain.",
        f"What is {a * 7} multiplied by {b + 11}, minus {c * 13}? Work it out step by step.",
    ]
    return rng.choice(templates).replace("{name}", name)


def training_prompts(count: int, files: list[Path], seed: int) -> list[TrainingPrompt]:
    """``count`` prompts, a fixed mix of kinds, in a seeded order."""
    rng = random.Random(seed)
    functions = _functions(files, rng, limit=count)
    paragraphs = _paragraphs()
    rng.shuffle(paragraphs)
    makers = {
        "question": lambda: rng.choice(QUESTION_TEMPLATES).format(*rng.sample(SUBJECTS, 2)),
        "writing": lambda: "Write " + rng.choice(WRITING).format(rng.choice(THINGS)) + ".",
        "math": lambda: _word_problem(rng),
    }
    if functions:
        makers["code writing"] = lambda: (
            "Write a Python function that does the following: " + rng.choice(functions)[1] + "."
        )
        makers["code editing"] = lambda: (
            rng.choice(CODE_EDITS) + "\n\n```python\n" + rng.choice(functions)[0] + "\n```"
        )
    if paragraphs:
        makers["summary"] = lambda: "Summarise the following text in two or three sentences:\n\n" + rng.choice(paragraphs)
        makers["translation"] = lambda: (
            f"Translate the following into {rng.choice(LANGUAGES)}:\n\n" + rng.choice(paragraphs)[:400]
        )
    kinds = sorted(makers)
    prompts = []
    seen: set[str] = set()
    attempts = 0
    while len(prompts) < count and attempts < count * 20:
        attempts += 1
        kind = kinds[len(prompts) % len(kinds)]
        text = makers[kind]()
        if text not in seen:
            seen.add(text)
            prompts.append(TrainingPrompt(kind, text))
    return prompts


# ----------------------------------------------------------------------------------------------------------------
# chat prompts: count-stable, so a larger set extends a smaller one


#: bumped when :func:`chat_prompts` would write a different prompt for some index
CHAT_PROMPTS_VERSION = 1
TOPICS = SUBJECTS + [
    "the moon landing", "the Industrial Revolution", "gravity", "the human heart", "earthquakes", "bees",
    "the Silk Road", "democracy", "the scientific method", "probability", "prime numbers", "electricity",
    "magnetism", "the periodic table", "climate adaptation", "urban gardening", "minimalism", "procrastination",
    "friendship", "teamwork", "negotiation", "first aid", "nutrition", "running a small business", "podcasts",
    "social media", "privacy online", "open-source software", "space exploration", "the Olympic Games",
    "ancient Egypt", "the Cold War", "impressionist painting", "classical music", "photography", "film editing",
    "poetry", "mythology", "philosophy of mind", "ethics of artificial intelligence", "game theory", "statistics",
    "linear algebra", "calculus", "thermodynamics", "the speed of light", "rainforests", "deserts", "glaciers",
]
#: people a model may be asked to play
PERSONAS = [
    "a museum guide", "a ship's captain", "a patient chess coach", "a travel agent", "a detective in 1920s London",
    "a medieval blacksmith", "a customer support agent", "a science teacher", "a personal trainer", "a chef",
    "a job interviewer", "a tour guide on Mars", "a librarian", "a startup founder pitching to investors",
    "a park ranger", "a grumpy but kind grandparent", "a radio host", "a gardener", "a film critic", "an astronaut",
]
ROLE_TASKS = [
    "Introduce yourself and describe a typical day.", "Answer a visitor who asks what you love most about your work.",
    "Give advice to someone who is just starting out in your line of work.",
    "Describe the most difficult moment of your career.", "Explain your job to a group of children.",
    "Respond to a customer who is unhappy with a delay.", "Tell a short story from your work.",
]
SITUATIONS = [
    "starting a new job next week", "moving to a new city where I know nobody", "preparing for a job interview",
    "trying to sleep better", "learning to cook on a budget", "planning a birthday party for my friend",
    "struggling to stay motivated while studying", "about to give my first conference talk",
    "deciding between two job offers", "trying to save money for a trip", "looking after a new puppy",
    "training for my first 10 km run", "writing my first novel", "managing a team for the first time",
]
ADVICE_ASKS = ["What would you suggest?", "What are the first three things I should do?",
               "What mistakes should I avoid?", "Can you give me a simple plan?", "How should I prepare?",
               "What questions should I ask myself first?"]
STYLES = ["formal", "casual", "enthusiastic", "concise", "humorous", "academic", "child-friendly"]
GENRES = [
    "a blog post", "a short speech", "a cover letter", "a product review", "a dialogue between two friends",
    "an essay outline", "a motivational message", "a thank-you note", "a short fairy tale", "a travel guide entry",
    "a recipe introduction", "a weather report in the style of a sports commentator", "a eulogy for a houseplant",
]
PLACES = ["Paris", "Tokyo", "a small coastal town", "the mountains", "Rome", "a national park", "New York",
          "Lisbon", "Istanbul", "a quiet countryside village", "Kyoto", "Barcelona"]
COLORS = ["red", "blue", "green", "yellow", "white", "black"]
FOODS = ["pasta", "soup", "curry", "salad", "pancakes", "rice", "tacos", "dumplings"]


def _article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _reasoning(rng: random.Random) -> str:
    """A small logic puzzle, made up from the name lists (its answer follows from the statement)."""
    kind = rng.randrange(4)
    if kind == 0:
        people = rng.sample(NAMES, 4)
        facts = [f"{people[i]} is taller than {people[i + 1]}" for i in range(3)]
        rng.shuffle(facts)
        return (". ".join(facts) + f". Who is the shortest, and is {people[0]} taller than {people[2]}? "
                "Explain your reasoning.")
    if kind == 1:
        people = rng.sample(NAMES, 3)
        colors = rng.sample(COLORS, 3)
        return (f"{people[0]}, {people[1]} and {people[2]} each own one car: one {colors[0]}, one {colors[1]} and "
                f"one {colors[2]}. {people[0]} does not own the {colors[0]} car. {people[1]} owns the {colors[2]} "
                "car. Who owns which car? Reason step by step.")
    if kind == 2:
        start, step = rng.randint(1, 20), rng.randint(2, 9)
        series = [start + step * i * (i + 1) // 2 for i in range(5)]
        return f"What number comes next in the sequence {', '.join(map(str, series))}? Explain the pattern."
    a, b = rng.sample(TOPICS, 2)
    return (f"All students who study {a} also study {b}. Some students who study {b} play chess. Does it follow "
            f"that some students who study {a} play chess? Explain carefully.")


def _extraction(rng: random.Random) -> str:
    """A short made-up text and a request to pull structured facts out of it."""
    people = rng.sample(NAMES, 3)
    day, month = rng.randint(1, 28), rng.choice(["March", "June", "September", "November"])
    food, place = rng.choice(FOODS), rng.choice(PLACES)
    text = (f"On {month} {day}, {people[0]} met {people[1]} in {place} to plan the summer fair. {people[1]} agreed to "
            f"bring {rng.randint(3, 30)} {rng.choice(ITEMS)}, and {people[2]} will cook {food} for "
            f"{rng.randint(10, 90)} guests. The budget is {rng.randint(2, 20) * 50} dollars.")
    ask = rng.choice(["Extract every person, date, place and number from this text as JSON.",
                      "List who does what in a table with two columns.",
                      "Answer in one sentence each: who, when, where, and how much money?"])
    return f"{text}\n\n{ask}"


def _stem(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 9), rng.randint(1, 30), rng.randint(31, 99)
    return rng.choice([
        f"Solve for x: {a}x + {b} = {c}. Show each step.",
        f"What is the derivative of {a}x^3 + {b}x^2 - {c}x? Explain the rule you use.",
        f"A ball is dropped from {c} metres. Ignoring air resistance, how long does it take to reach the ground?",
        f"Explain how {rng.choice(TOPICS)} works, with one equation if it helps.",
        f"What is the probability of rolling a total of {rng.randint(2, 12)} with two fair dice? Explain.",
        f"Convert {c} degrees Fahrenheit to Celsius and explain the formula.",
        f"How many different ways can {a} people sit in a row? Explain why.",
    ])


def chat_prompt(index: int, seed: int, paragraphs: list[str]) -> TrainingPrompt:
    """Chat prompt number ``index`` of the set for ``seed``: a function of the two alone (and the language
    reference's paragraphs), so ``chat_prompts(n)`` is the first n of ``chat_prompts(m)`` for every m > n."""
    rng = random.Random(f"chat/{CHAT_PROMPTS_VERSION}/{seed}/{index}")
    makers = {
        "advice": lambda: f"I'm {rng.choice(SITUATIONS)}. {rng.choice(ADVICE_ASKS)}",
        "explanation": lambda: rng.choice(QUESTION_TEMPLATES).format(*rng.sample(TOPICS, 2)),
        "extraction": lambda: _extraction(rng),
        "humanities": lambda: rng.choice([
            "What were the main causes and consequences of {}?", "Why is {} still studied today?",
            "Write a short essay on how {} changed people's lives.", "Give a balanced view of the debate about {}.",
        ]).format(rng.choice(TOPICS)),
        "list": lambda: f"List {rng.randint(5, 10)} interesting facts about {rng.choice(TOPICS)}, one line each.",
        "math reasoning": lambda: _word_problem(rng),
        "plan": lambda: rng.choice([
            f"Plan a {rng.randint(2, 5)}-day trip to {rng.choice(PLACES)}.",
            f"Make a {rng.randint(2, 8)}-week study plan for learning {rng.choice(TOPICS)}.",
            f"Give me a weekly meal plan built around {rng.choice(FOODS)}.",
        ]),
        "reasoning": lambda: _reasoning(rng),
        "rewrite": lambda: (f"Rewrite this in {_article(rng.choice(STYLES))} tone:\n\n"
                            + (rng.choice(paragraphs)[:500] if paragraphs else rng.choice(TOPICS))),
        "roleplay": lambda: f"You are {rng.choice(PERSONAS)}. {rng.choice(ROLE_TASKS)}",
        "stem": lambda: _stem(rng),
        "writing": lambda: f"Write {rng.choice(GENRES)} about {rng.choice(THINGS + TOPICS)}.",
    }
    kinds = sorted(makers)
    kind = kinds[index % len(kinds)]
    return TrainingPrompt(kind, makers[kind]())


def chat_prompts(count: int, seed: int) -> list[TrainingPrompt]:
    """The first ``count`` distinct chat prompts for ``seed`` (advice, explanations, extraction, humanities,
    lists, arithmetic, plans, reasoning puzzles, rewriting, role play, STEM, writing; one kind after another).
    Drawn in index order and repeats skipped, so the first n of a larger set are the set of n."""
    paragraphs = _paragraphs()
    prompts: list[TrainingPrompt] = []
    seen: set[str] = set()
    index = 0
    while len(prompts) < count and index < 20 * count + 100:
        prompt = chat_prompt(index, seed, paragraphs)
        index += 1
        if prompt.text not in seen:
            seen.add(prompt.text)
            prompts.append(prompt)
    return prompts


# ----------------------------------------------------------------------------------------------------------------
# passage prompts: a text in the prompt, an answer that transforms it


#: bumped when :func:`passage_prompt` would write a different prompt for some index or passage
PASSAGE_PROMPTS_VERSION = 1
#: the longest passage a prompt quotes, in words (cut at a paragraph or a sentence end)
PASSAGE_WORDS = 160
SUMMARY_ASKS = [
    "Summarize: {text}",
    "Summarize the following text in {n} sentences.\n\n{text}",
    "Summarize the following passage in one paragraph of about {words} words, then list three key takeaways as "
    "bullet points.\n\n{text}",
    "Write a headline and a two-sentence summary of this text:\n\n{text}",
    "{text}\n\nWhat is the gist of the text above? Answer in {n} sentences.",
]
TRANSLATION_ASKS = [
    "Translate the following text into {language}:\n\n{text}",
    "Translate English to {language}: {text}",
    "Translate this paragraph into {language}, keeping its tone:\n\n{text}",
]
QUESTION_ASKS = [
    "{text}\n\nBased on the text above, what is its main point?",
    "{text}\n\nAccording to the text, what reasons or examples are given? Answer briefly.",
    "Read the text and answer the question.\n\nText: {text}\n\nQuestion: Who is this text written for, and how can "
    "you tell?",
    "{text}\n\nUsing only the passage above, name two things a reader should remember.",
    "Answer from the passage alone.\n\nPassage: {text}\n\nQuestion: Which claim in the passage would you check "
    "first, and why?",
]
EXTRACTION_ASKS = [
    "List every name, number and place mentioned in the text below as JSON (empty lists where there are none).\n\n"
    "{text}",
    "Turn this text into a short FAQ of three questions and answers:\n\n{text}",
    "{text}\n\nMake a table of the main points of this text, one row each, with a short example for each.",
    "Extract the steps or recommendations in this text as a numbered list:\n\n{text}",
]


def _cut(paragraph: str, words: int) -> str:
    """The first ``words`` words of ``paragraph``, ended at its last sentence end when that keeps a third."""
    cut = " ".join(paragraph.split()[:words])
    end = max(cut.rfind(". "), cut.rfind("! "), cut.rfind("? "))
    return cut[: end + 1] if end > len(cut) // 3 else cut


def passage(text: str, words: int = PASSAGE_WORDS) -> str:
    """The start of ``text`` as a passage to quote, at most ``words`` words: its markdown emphasis and heading
    marks removed, whole paragraphs while they fit, and while it holds under half of ``words``, the start of the
    next paragraph up to a sentence end."""
    paragraphs = [" ".join(block.replace("**", "").replace("__", "").lstrip("#").split())
                  for block in text.split("\n\n")]
    kept: list[str] = []
    count = 0
    for paragraph in (p for p in paragraphs if p):
        size = len(paragraph.split())
        if count + size <= words:
            kept.append(paragraph)
            count += size
            continue
        if count < words // 2:
            kept.append(_cut(paragraph, words - count))
        break
    return "\n\n".join(kept)


def passage_prompt(index: int, seed: int, text: str) -> TrainingPrompt:
    """Passage prompt number ``index`` for ``seed`` over ``text`` (the target's answer to chat prompt ``index``):
    a summary, a translation, a question over the passage or an extraction from it; a function of the three
    alone, so a larger set extends a smaller one."""
    rng = random.Random(f"passage/{PASSAGE_PROMPTS_VERSION}/{seed}/{index}")
    kind = ("summary", "translation", "question", "extraction")[rng.randrange(4)]
    quoted = passage(text)
    if kind == "translation":  # a paragraph or two: a translation is longer than its source
        quoted = passage(text, PASSAGE_WORDS // 2)
        return TrainingPrompt(kind, rng.choice(TRANSLATION_ASKS).format(
            language=rng.choice(LANGUAGES), text=quoted))
    if kind == "summary":
        ask = rng.choice(SUMMARY_ASKS)
        if ask.startswith("Summarize: "):
            quoted = " ".join(quoted.split())  # one block, as a news text arrives
        return TrainingPrompt(kind, ask.format(text=quoted, n=rng.randint(2, 4), words=rng.choice([40, 60, 80])))
    asks = QUESTION_ASKS if kind == "question" else EXTRACTION_ASKS
    return TrainingPrompt(kind, rng.choice(asks).format(text=quoted))


def passage_prompts(chat_answers: list[dict], seed: int) -> list[TrainingPrompt]:
    """One passage prompt per chat answer, in order: prompt i quotes the target's answer to chat prompt i (its
    ``answer`` text), so prompt i is held out exactly when the answer it quotes is."""
    return [passage_prompt(i, seed, row["answer"]) for i, row in enumerate(chat_answers)]

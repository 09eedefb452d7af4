"""Prompts for self-distilled Medusa training, built offline from the Python standard library and a few word lists.

The target answers these prompts itself (``medusa_train``), so the heads learn to guess the target's own way of
writing chat answers: explanations, code, edits, summaries, translations, worked arithmetic, short pieces of
writing. The material is the standard library's functions and docstrings and the language reference's prose
(``pydoc_data``); the word lists below are the project's own. The benchmark prompt files are never read.
"""

from __future__ import annotations

import ast
import random
import textwrap
from dataclasses import dataclass
from pathlib import Path

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


def _functions(files: list[Path], rng: random.Random, limit: int) -> list[tuple[str, str]]:
    """(source, first docstring sentence) of standard-library functions of 4 to 30 lines with a docstring."""
    found: list[tuple[str, str]] = []
    shuffled = list(files)
    rng.shuffle(shuffled)
    for path in shuffled:
        if len(found) >= limit:
            break
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            source = ast.get_source_segment(text, node, padded=True)
            if not doc or not source or not 4 <= source.count("\n") <= 30:
                continue
            sentence = doc.strip().split("\n\n")[0].replace("\n", " ").split(". ")[0].strip().rstrip(".")
            if 20 <= len(sentence) <= 160:
                found.append((textwrap.dedent(source), sentence))
                break  # one function per file keeps the mix broad
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

"""The embedded default corpus: English-like text from a small grammar, generated from a fixed seed.

Nothing is downloaded. The text is built so that a tiny byte-level transformer learns visible structure in
a couple of hundred steps: a small vocabulary of words, short sentences with agreement, facts that repeat
word for word, counting, days of the week and months in order, and one-digit sums. A demo prompt such as
"After Monday comes " or "3 + 4 = " then gets a recognisable continuation.
"""
from __future__ import annotations

import functools
import random

SEED = 20240611
TARGET_CHARS = 400_000

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
                "nineteen", "twenty"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]

# (singular, plural) so sentences agree in number.
# Word lists are short on purpose: a small vocabulary is what a tiny model can learn in a few hundred steps.
ANIMALS = [("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("fox", "foxes"), ("mouse", "mice")]
THINGS = [("ball", "balls"), ("apple", "apples"), ("book", "books"), ("box", "boxes")]
ADJECTIVES = ["small", "big", "old", "happy", "red"]
# (third person singular, plural/base) forms.
VERBS = [("sees", "see"), ("likes", "like"), ("chases", "chase"), ("finds", "find")]
PLACES = ["in the garden", "near the river", "under the tree", "in the house"]
NAMES = ["Tom", "Anna", "Sam", "Lily", "Ben"]
FRUITS = ["apples", "pears", "cakes"]
FACTS = [
    "The sky is blue.", "Snow is white.", "Grass is green.", "Fire is hot.", "Ice is cold.",
    "The sun rises in the east.", "The sun sets in the west.", "Fish live in water.", "Birds can fly.",
    "Cows eat grass.", "Bees make honey.", "A week has seven days.", "A year has twelve months.",
    "The moon shines at night.", "Sugar is sweet.", "A cat says meow.", "A dog says woof.",
]
COLOURS = [("apple", "red"), ("banana", "yellow"), ("leaf", "green"), ("sky", "blue"), ("snow", "white"),
           ("coal", "black")]


def _noun_phrase(rng: random.Random, plural: bool, pool: list[tuple[str, str]]) -> str:
    noun = rng.choice(pool)[1 if plural else 0]
    if rng.random() < 0.5:
        noun = f"{rng.choice(ADJECTIVES)} {noun}"
    return f"the {noun}"


def _svo(rng: random.Random) -> str:
    plural = rng.random() < 0.3
    subject = _noun_phrase(rng, plural, ANIMALS)
    verb = rng.choice(VERBS)[1 if plural else 0]
    obj = _noun_phrase(rng, rng.random() < 0.3, THINGS + ANIMALS)
    place = f" {rng.choice(PLACES)}" if rng.random() < 0.4 else ""
    return f"{subject.capitalize()} {verb} {obj}{place}."


def _counting(rng: random.Random) -> str:
    # Counting starts at one most of the time, so the sequence itself is what gets learned.
    start = 1 if rng.random() < 0.7 else rng.randint(2, 10)
    n = rng.randint(3, 10)
    if rng.random() < 0.5:
        return "Count with me: " + ", ".join(NUMBER_WORDS[start:start + n]) + "."
    return "Count: " + " ".join(str(i) for i in range(start, start + n)) + "."


def _days(rng: random.Random) -> str:
    i = rng.randrange(7)
    kind = rng.randrange(3)
    if kind == 0:
        return f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}."
    if kind == 1:
        return f"Today is {DAYS[i]}, so tomorrow is {DAYS[(i + 1) % 7]}."
    return "The days of the week are " + ", ".join(DAYS[:-1]) + f" and {DAYS[-1]}."


def _months(rng: random.Random) -> str:
    i = rng.randrange(12)
    if rng.random() < 0.7:
        return f"After {MONTHS[i]} comes {MONTHS[(i + 1) % 12]}."
    return f"{MONTHS[i]} is month number {NUMBER_WORDS[i + 1]}."


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    kind = rng.randrange(3)
    if kind == 0:
        return f"{a} + {b} = {a + b}."
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"{a} - {b} = {a - b}."
    a, b = rng.randint(0, 5), rng.randint(0, 5)
    return f"{NUMBER_WORDS[a].capitalize()} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}."


def _story(rng: random.Random) -> str:
    who, other = rng.sample(NAMES, 2)
    what = rng.choice(FRUITS)
    a, b = rng.randint(1, 6), rng.randint(1, 4)
    return f"{who} has {a} {what}. {other} gives {who} {b} more. Now {who} has {a + b} {what}."


def _colour(rng: random.Random) -> str:
    thing, colour = rng.choice(COLOURS)
    return f"The {thing} is {colour}."


def _fact(rng: random.Random) -> str:
    return rng.choice(FACTS)


# Sentence makers and how often each is picked: plain sentences dominate, structured ones recur often
# enough to be learned.
_MAKERS = [(_svo, 5), (_fact, 3), (_counting, 2), (_days, 2), (_months, 1), (_arithmetic, 3), (_story, 1),
           (_colour, 2)]


def generate(seed: int = SEED, target_chars: int = TARGET_CHARS) -> str:
    """Text from the grammar: paragraphs of 3 to 6 sentences until `target_chars` is reached."""
    rng = random.Random(seed)
    makers = [m for m, _ in _MAKERS]
    weights = [w for _, w in _MAKERS]
    paragraphs: list[str] = []
    size = 0
    while size < target_chars:
        sentences = [rng.choices(makers, weights)[0](rng) for _ in range(rng.randint(3, 6))]
        paragraph = " ".join(sentences)
        paragraphs.append(paragraph)
        size += len(paragraph) + 1
    return "\n".join(paragraphs) + "\n"


# The held-out split: the same grammar from another seed, so validation measures what the model learned of the
# grammar, on paragraphs training never reads (the training text is untouched by it).
VALID_SEED = SEED + 1
VALID_CHARS = 40_000


@functools.lru_cache(maxsize=1)
def embedded_validation() -> str:
    """The embedded corpus's held-out split (about 40 KB), for validation loss; training never reads it."""
    return generate(VALID_SEED, VALID_CHARS)


@functools.lru_cache(maxsize=1)
def embedded_corpus() -> str:
    """The default training text (about 400 KB, ASCII), identical on every call and every machine."""
    return generate()

"""Generate the bundled synthetic conversation set (``conversations.jsonl``).

Every conversation is produced here from small hand-written word lists and a seeded
random generator, so the set carries no third-party text. Run from the repository root:

    PYTHONPATH=src python src/openrecipes/data/assets/make_conversations.py

The output is byte-identical for a given ``--seed`` and ``--count``. The benchmark
(bench/data_build.py) calls :func:`generate` with a larger count.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any, Iterator

SYSTEM_PROMPTS = [
    "You are a concise assistant. Answer in plain sentences.",
    "You are a patient tutor who explains each step.",
    "You are a helpful assistant for a small workshop. Keep answers short.",
    "You answer questions about numbers, units and words.",
]
NAMES = ["Ada", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun"]
ITEMS = ["apples", "bolts", "cables", "books", "lamps", "tiles", "seeds", "cups", "pens", "boxes"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Tunis", "Quito", "Perth", "Hanoi", "Turin"]
WEATHER = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy"]
UNITS = [("kilometers", "meters", 1000), ("hours", "minutes", 60), ("kilograms", "grams", 1000),
         ("liters", "milliliters", 1000), ("minutes", "seconds", 60)]
WORDS = {
    "river": "a natural stream of water flowing toward a sea or lake",
    "ledger": "a book or file in which money going in and out is recorded",
    "lantern": "a lamp with a transparent case that protects the flame",
    "harvest": "the time of gathering crops, or the crops gathered",
    "compass": "an instrument whose needle points to magnetic north",
    "orchard": "a piece of land planted with fruit trees",
    "quarry": "a place where stone is dug out of the ground",
    "anchor": "a heavy object that holds a ship in place",
    "glacier": "a slow river of ice formed from packed snow",
    "furnace": "an enclosed structure in which material is heated",
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]


def _arithmetic(rng: random.Random) -> list[dict[str, Any]]:
    a, b, name, item = rng.randint(2, 99), rng.randint(2, 99), rng.choice(NAMES), rng.choice(ITEMS)
    question = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?"
    answer = f"{name} starts with {a} {item} and adds {b}, so {name} has {a} + {b} = {a + b} {item}."
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.5:
        c = rng.randint(2, 9)
        turns += [{"role": "user", "content": f"And if each of them costs {c} coins?"},
                  {"role": "assistant", "content": f"Then the {a + b} {item} cost {a + b} x {c} = "
                                                   f"{(a + b) * c} coins in total."}]
    return turns


def _units(rng: random.Random) -> list[dict[str, Any]]:
    big, small, factor = rng.choice(UNITS)
    value = rng.randint(1, 50)
    return [{"role": "user", "content": f"Convert {value} {big} to {small}."},
            {"role": "assistant", "content": f"One of the {big} is {factor} {small}, so {value} {big} "
                                             f"is {value * factor} {small}."}]


def _definition(rng: random.Random) -> list[dict[str, Any]]:
    word = rng.choice(sorted(WORDS))
    turns = [{"role": "user", "content": f"What does the word \"{word}\" mean?"},
             {"role": "assistant", "content": f"A {word} is {WORDS[word]}."}]
    if rng.random() < 0.4:
        turns += [{"role": "user", "content": "Use it in a sentence, please."},
                  {"role": "assistant", "content": f"{rng.choice(NAMES)} walked past the {word} "
                                                   f"on the way to {rng.choice(CITIES)}."}]
    return turns


def _sorting(rng: random.Random) -> list[dict[str, Any]]:
    values = [rng.randint(0, 500) for _ in range(rng.randint(4, 9))]
    reasoning = (f"I compare the numbers {', '.join(map(str, values))} and place the smallest first; "
                 f"the smallest is {min(values)} and the largest is {max(values)}.")
    return [{"role": "user", "content": f"Sort these numbers: {', '.join(map(str, values))}"},
            {"role": "assistant", "reasoning_content": reasoning,
             "content": f"Sorted: {', '.join(map(str, sorted(values)))}."}]


def _weather_tool(rng: random.Random) -> list[dict[str, Any]]:
    city, sky, temp = rng.choice(CITIES), rng.choice(WEATHER), rng.randint(-5, 35)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
    return [{"role": "user", "content": f"What is the weather like in {city} right now?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": json.dumps({"city": city, "sky": sky, "celsius": temp})},
            {"role": "assistant", "content": f"It is {sky} in {city}, around {temp} degrees Celsius."}]


def _calculator_tool(rng: random.Random) -> list[dict[str, Any]]:
    a, b, c = rng.randint(10, 999), rng.randint(10, 999), rng.randint(2, 12)
    first, second = f"{a} * {c}", f"{b} * {c}"
    calls = [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
             for e in (first, second)]
    return [{"role": "user", "content": f"Compute {first} and {second} for me."},
            {"role": "assistant", "content": "I will compute both products.", "tool_calls": calls},
            {"role": "tool", "content": str(a * c)},
            {"role": "tool", "content": str(b * c)},
            {"role": "assistant", "content": f"{first} = {a * c} and {second} = {b * c}."}]


def _story(rng: random.Random) -> list[dict[str, Any]]:
    name, city, item = rng.choice(NAMES), rng.choice(CITIES), rng.choice(ITEMS)
    sentences = [f"{name} lived in {city} and collected {item}.",
                 f"Every morning {name} counted the {item} twice.",
                 f"One day the {item} were gone, and {name} searched the whole street.",
                 f"A neighbor had borrowed them and brought them back with a note.",
                 f"From then on {name} kept the {item} in a box by the door."]
    return [{"role": "user", "content": f"Tell me a short story about {name} in {city}."},
            {"role": "assistant", "content": " ".join(sentences[: rng.randint(3, 5)])}]


KINDS = [_arithmetic, _units, _definition, _sorting, _weather_tool, _calculator_tool, _story]


def generate(count: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Yield ``count`` conversation records ``{"messages": [...], "metadata": {...}}``."""
    rng = random.Random(seed)
    for index in range(count):
        kind = rng.choice(KINDS)
        messages = kind(rng)
        if rng.random() < 0.4:
            messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] + messages
        metadata: dict[str, Any] = {"id": f"synthetic-{seed}-{index}", "kind": kind.__name__.lstrip("_")}
        if kind in (_weather_tool, _calculator_tool):
            metadata["tools"] = TOOLS
        yield {"messages": messages, "metadata": metadata}


def write_jsonl(path: Path, count: int, seed: int) -> None:
    from openrecipes.utils import atomic_write_path

    with atomic_write_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for record in generate(count, seed):
            handle.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("conversations.jsonl"))
    args = parser.parse_args()
    write_jsonl(args.out, args.count, args.seed)


if __name__ == "__main__":
    main()

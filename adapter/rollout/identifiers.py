"""Opaque identifiers asked back verbatim, the check of sgl-project/sglang#34959: DSpark at
draft blocks above the model's KV compression ratio corrupted identifiers silently, every
rank committing the same wrong token, so neither rank agreement nor accept length saw it.

The identifiers come from a seed (random.Random: the same seed, the same list, anywhere) in the
shapes real ones have: hashes, UUIDs, snake_case and camelCase names with digits, API-key-like
tokens, dotted and dashed host or path names. None holds whitespace, a quote or a backtick, so
an answer's line can be read back without guessing. A prompt lists several, numbered; the
answer is read back by number, and each identifier's edits are the Levenshtein distance between
it and what came back (a missing one: its whole length)."""

from __future__ import annotations

import random
import re
import string
import uuid

WORDS = ("cache", "block", "token", "rank", "draft", "verify", "accept", "shard", "page", "batch", "queue", "graph",
         "kernel", "stream", "buffer", "index", "layer", "expert", "router", "tensor", "replica", "commit", "fence",
         "sync", "probe", "window", "prefix", "suffix", "node", "zone", "region", "bucket", "ledger", "session")
ALNUM = string.ascii_letters + string.digits
PROMPT = ("Repeat each identifier below exactly as written, character for character: one per line, in the same "
          "order, each after its number, and write nothing else.\n\n")
ANSWER_LINE = re.compile(r"^\s*(?:[-*]\s*)?(\d+)\s*[.):]\s*(.*?)\s*$")
WRAPPERS = ("`", '"', "'", "**", "*")  # what a model may put around an identifier it was asked to repeat


def _hex(rng: random.Random, length: int) -> str:
    return f"{rng.getrandbits(4 * length):0{length}x}"


def _hash(rng):
    return _hex(rng, rng.choice((7, 12, 16, 40)))


def _uuid(rng):
    text = str(uuid.UUID(int=rng.getrandbits(128)))
    return text.upper() if rng.random() < 0.3 else text


def _snake(rng):
    parts = rng.sample(WORDS, rng.randint(2, 4)) + [_hex(rng, rng.randint(2, 5))]
    if rng.random() < 0.5:
        parts.append(rng.choice(("v", "r", "x", "Q")) + str(rng.randint(0, 99)))
    return "_".join(parts)


def _camel(rng):
    words = rng.sample(WORDS, rng.randint(2, 4))
    name = words[0] + "".join(w.capitalize() for w in words[1:])
    return name + str(rng.randint(0, 9999)) + rng.choice(("", "Ab", "X", "Id"))


def _key(rng):
    body = "".join(rng.choice(ALNUM) for _ in range(rng.randint(10, 24)))
    return rng.choice(("", "sk-", "tok_", "key-", "AKIA")) + body


def _host(rng):
    sep = rng.choice((".", "-", "/"))
    parts = [rng.choice(WORDS) + str(rng.randint(1, 99)), rng.choice(WORDS) + "_" + _hex(rng, 3).upper(),
             rng.choice(("eu-west-2", "us-east-1", "ap-south-1", "c7g", "p5e"))]
    return sep.join(parts)


SHAPES = (_hash, _uuid, _snake, _camel, _key, _host)


def make(count: int, seed: int) -> list:
    """`count` distinct identifiers, the same for the same seed."""
    rng = random.Random(seed)
    made, seen = [], set()
    while len(made) < count:
        identifier = rng.choice(SHAPES)(rng)
        if identifier not in seen:
            seen.add(identifier)
            made.append(identifier)
    return made


def prompt(identifiers) -> str:
    return PROMPT + "\n".join(f"{n}. {identifier}" for n, identifier in enumerate(identifiers, 1))


def read_back(text: str, count: int) -> list:
    """What an answer gives for identifiers 1..count, in order (None: that number never came
    back): the first line numbered n, without a pair of wrappers around it."""
    found = {}
    for line in text.splitlines():
        match = ANSWER_LINE.match(line)
        if match and 1 <= int(match.group(1)) <= count and int(match.group(1)) not in found:
            found[int(match.group(1))] = unwrapped(match.group(2))
    return [found.get(n) for n in range(1, count + 1)]


def unwrapped(text: str) -> str:
    for mark in WRAPPERS:
        if len(text) > 2 * len(mark) and text.startswith(mark) and text.endswith(mark):
            return text[len(mark):-len(mark)]
    return text


def edits(asked: str, answered) -> int:
    """Levenshtein distance (insertions, deletions, substitutions); nothing answered is the
    whole identifier to insert."""
    if answered is None:
        return len(asked)
    if answered == asked:
        return 0
    previous = list(range(len(answered) + 1))
    for i, a in enumerate(asked, 1):
        current = [i]
        for j, b in enumerate(answered, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (a != b)))
        previous = current
    return previous[-1]

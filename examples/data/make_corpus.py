"""Regenerate corpus.jsonl: small, original, deterministic English prose for tests and examples.

Short "field notes" built from hand-written sentence templates and word lists (no external text),
so the byte-level model has real structure to learn: spelling, punctuation, repeated phrases.
    python examples/data/make_corpus.py > examples/data/corpus.jsonl
"""

import json
import random

PLACES = ["the harbor", "the old mill", "the river bend", "the north field", "the market square",
          "the lighthouse", "the orchard", "the stone bridge", "the library", "the hill road"]
PEOPLE = ["the miller", "a fisherman", "the schoolteacher", "two children", "the baker",
          "an old sailor", "the clockmaker", "a traveler", "the gardener", "the ferryman"]
THINGS = ["a lantern", "a basket of apples", "a brass key", "a folded map", "a wooden boat",
          "a loaf of bread", "a bundle of letters", "a copper kettle", "a small dog", "a red kite"]
WEATHER = ["The morning was cold and clear.", "Rain fell softly through the afternoon.",
           "A warm wind came in from the sea.", "Fog lay over the water until noon.",
           "The evening sky turned gold and then grey.", "Snow had covered the roofs overnight."]
VERBS = ["carried", "found", "repaired", "sold", "painted", "lost", "borrowed", "counted"]
ENDINGS = ["and nobody said a word about it.", "before the bells rang at six.",
           "while the tide went out.", "as the lamps were lit one by one.",
           "and then went home for supper.", "though it was already late."]


def sentence(rng):
    pattern = rng.randrange(4)
    p, q = rng.choice(PEOPLE), rng.choice(PEOPLE)
    if pattern == 0:
        return f"{p.capitalize()} {rng.choice(VERBS)} {rng.choice(THINGS)} near {rng.choice(PLACES)} {rng.choice(ENDINGS)}"
    if pattern == 1:
        return f"At {rng.choice(PLACES)}, {p} met {q}, who had {rng.choice(VERBS)} {rng.choice(THINGS)}."
    if pattern == 2:
        n = rng.randrange(2, 40)
        return f"By our count there were {n} boats at {rng.choice(PLACES)}, {n * 3} gulls, and one {rng.choice(['cat', 'goat', 'heron'])}."
    return rng.choice(WEATHER)


def document(rng, i):
    lines = [f"Field note {i + 1}."]
    for _ in range(rng.randrange(4, 12)):
        lines.append(sentence(rng))
    return " ".join(lines)


def main(num_docs=400, seed=7):
    rng = random.Random(seed)
    for i in range(num_docs):
        print(json.dumps({"text": document(rng, i)}))


if __name__ == "__main__":
    main()

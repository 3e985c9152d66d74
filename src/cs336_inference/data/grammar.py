"""A seeded grammar of stories, dialogues and ledgers with long-range structure.

Every document names its entities early and refers back to them much later, so a model can only
predict those later bytes by attending far back (what sliding windows and small KV caches lose).
Ledgers are the sharpest case: a line such as "Mara's code is 739." is restated, hundreds of bytes
later, as "Check: Mara's code is 739."; the three digits are random, so they are predictable only
by copying them from the first mention (an induction-head task, Olsson et al. 2022).

All randomness comes from the `random.Random` passed in, so a seed fixes the text exactly.
"""

from __future__ import annotations

import random

NAMES = (
    "Mara Tobin Alice Bruno Cleo Dario Elsa Farid Greta Hugo Ines Jonas Kira Leon Maya Nico Olga "
    "Pavel Quinn Rosa Sami Tara Umar Vera Wren Xavi Yara Zane Amos Bea Cyrus Dina Emil Fay Gideon "
    "Hana Ivo Jade Kofi Lina Milo Nora Oscar Pia Rafe Sara Theo Uma Viggo Willa Aria Basil Cora "
    "Dmitri Edda Felix Gwen Hector Isla Juno Kai Luz Mateo Nadia Orin Petra Ravi Selma Tomas Ulla "
    "Vito Wanda Yusuf Zora Anselm Brigid Cosmo Delia Ezra Flora Gus Hilde Ike Joan Kurt Lotte Marek "
    "Nell Otto Priya Remy Sven Tilda Ugo Vesna Wim Yves Zelda"
).split()
TOWNS = (
    "Ashford Brimley Caldera Dunmore Eastwick Fernhill Glenrock Harrowgate Ivybridge Juniper Kestrel "
    "Larkspur Millbrook Northcote Oakhaven Pinecrest Queensbury Riverton Saltmarsh Thornbury "
    "Underhill Valewood Westmere Yarrow"
).split()
ROLES = ("baker smith weaver sailor miller potter farmer teacher painter doctor carpenter "
         "gardener librarian fisher tailor cook shepherd clockmaker").split()
ANIMALS = "cat dog goat owl horse fox crow rabbit donkey parrot tortoise hen".split()
PET_NAMES = ("Pip Rusty Bramble Pepper Biscuit Clover Ember Juniper Mochi Nutmeg Pebble Quill "
             "Saffron Tansy Waffle Ziggy Barley Cricket Dot Fennel").split()
COLORS = "red blue green grey golden silver black white brown amber violet copper".split()
OBJECTS = ("key lantern map compass ring book flute kettle box coin mirror scarf hammer "
           "clock basket letter").split()
PLACES = ("market harbour bridge forest mill library square orchard chapel meadow tower "
          "bakery workshop river well garden").split()
TIMES = "morning afternoon evening night dawn".split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
WEATHER = ("the rain fell softly", "the wind was cold", "the sun was bright", "fog covered the hills",
           "snow lay on the roofs", "the air smelled of bread", "clouds drifted from the sea")
FEELINGS = "happy tired curious worried calm proud hungry sleepy cheerful restless".split()
ITEMS = "bread apples nails wool candles rope salt flour honey cheese ink thread".split()
TOPICS = ("the weather", "the harvest", "the new bridge", "the old mill", "the river", "the market prices",
          "the festival", "a letter from the city", "the broken clock", "the winter stores")


def _pick(rng: random.Random, seq):
    return seq[rng.randrange(len(seq))]


def _pronoun(rng: random.Random) -> tuple[str, str, str]:
    return _pick(rng, (("she", "her", "her"), ("he", "him", "his"), ("they", "them", "their")))


def filler_sentence(rng: random.Random) -> str:
    """A sentence that names no document entity: the distance between a fact and its recall."""
    k = rng.randrange(8)
    if k == 0:
        return f"On {_pick(rng, DAYS)} {_pick(rng, WEATHER)}."
    if k == 1:
        return (f"The {_pick(rng, PLACES)} was {_pick(rng, ('quiet', 'busy', 'crowded', 'empty', 'noisy'))} "
                f"that {_pick(rng, TIMES)}.")
    if k == 2:
        return (f"A {_pick(rng, ROLES)} sold {rng.randint(2, 40)} baskets of {_pick(rng, ITEMS)} "
                f"at the {_pick(rng, PLACES)}.")
    if k == 3:
        return f"Someone had painted the door of the {_pick(rng, PLACES)} {_pick(rng, COLORS)}."
    if k == 4:
        return f"People talked about {_pick(rng, TOPICS)} for a long time."
    if k == 5:
        return f"The {_pick(rng, ANIMALS)} near the {_pick(rng, PLACES)} looked {_pick(rng, FEELINGS)}."
    if k == 6:
        return f"By {_pick(rng, TIMES)} the price of {_pick(rng, ITEMS)} had gone up to {rng.randint(2, 99)} coins."
    return f"Nobody in the {_pick(rng, PLACES)} said a word about {_pick(rng, TOPICS)}."


def filler(rng: random.Random, num_bytes: int) -> str:
    """Whole filler sentences adding up to at least `num_bytes` bytes (none if num_bytes <= 0)."""
    parts, size = [], 0
    while size < num_bytes:
        sentence = filler_sentence(rng)
        parts.append(sentence)
        size += len(sentence) + 1
    return " ".join(parts)


def story(rng: random.Random) -> str:
    """A hero, a pet, a town and an object introduced at the top and all recalled at the end."""
    hero, friend = rng.sample(NAMES, 2)
    town, role, animal, pet = _pick(rng, TOWNS), _pick(rng, ROLES), _pick(rng, ANIMALS), _pick(rng, PET_NAMES)
    color, obj = _pick(rng, COLORS), _pick(rng, OBJECTS)
    subj, obj_pron, poss = _pronoun(rng)
    lines = [f"Once upon a time, in the town of {town}, there lived a {role} named {hero}. "
             f"{hero} had a {animal} called {pet} and a {color} {obj} that nobody else could use."]
    for _ in range(rng.randint(4, 12)):
        k = rng.randrange(6)
        if k == 0:
            lines.append(f"One {_pick(rng, TIMES)}, {subj} walked to the {_pick(rng, PLACES)} "
                         f"to buy {_pick(rng, ITEMS)}.")
        elif k == 1:
            lines.append(f"There {subj} met a {_pick(rng, ROLES)} named {friend}, who asked about the {obj}.")
        elif k == 2:
            lines.append(f"{friend} told {obj_pron} a long story about {_pick(rng, TOPICS)}.")
        elif k == 3:
            lines.append(f"{subj.capitalize()} felt {_pick(rng, FEELINGS)} and kept {poss} hands in {poss} pockets.")
        else:
            lines.append(filler(rng, rng.randint(40, 160)))
    lines.append(f"At last {hero} came home to {town}, where {pet} the {animal} was waiting "
                 f"by the door next to the {color} {obj}. {hero} the {role} smiled and said goodnight to {friend}.")
    return "\n".join(lines)


def dialogue(rng: random.Random) -> str:
    """Two speakers agree on a number and a place early, and confirm both at the end."""
    a, b = rng.sample(NAMES, 2)
    number, place, item = rng.randint(10, 999), _pick(rng, PLACES), _pick(rng, ITEMS)
    turns = [f"{a}: Good {_pick(rng, TIMES)}, {b}. Did you bring the {number} sacks of {item}?",
             f"{b}: I did, {a}. They are waiting at the {place}."]
    speakers = (a, b)
    for i in range(rng.randint(3, 10)):
        speaker, other = speakers[i % 2], speakers[1 - i % 2]
        k = rng.randrange(4)
        if k == 0:
            turns.append(f"{speaker}: What do you think about {_pick(rng, TOPICS)}, {other}?")
        elif k == 1:
            turns.append(f"{speaker}: I feel {_pick(rng, FEELINGS)} today. {filler_sentence(rng)}")
        else:
            turns.append(f"{speaker}: {filler(rng, rng.randint(30, 120))}")
    turns.append(f"{a}: So, {b}: {number} sacks of {item} at the {place}?")
    turns.append(f"{b}: Yes, {a}, {number} sacks of {item} at the {place}. See you there.")
    return "\n".join(turns)


def fact_prefix(name: str) -> str:
    return f"{name}'s code is "


def fact_line(name: str, value: str) -> str:
    return f"{fact_prefix(name)}{value}."


def query_prefix(name: str) -> str:
    """What a recall query looks like up to (not including) the value the model must copy."""
    return f"Check: {name}'s code is "


def random_value(rng: random.Random, digits: int = 3) -> str:
    return "".join(str(rng.randrange(10)) for _ in range(digits))


def ledger(rng: random.Random, digits: int = 3) -> str:
    """Key-value facts, filler, new facts, and checks of earlier facts at distances of 0-1500 bytes."""
    number = rng.randint(1, 9999)
    lines = [f"Ledger {number}."]
    facts: dict[str, str] = {}
    names = rng.sample(NAMES, rng.randint(3, 8))
    for name in names[:rng.randint(1, 3)]:
        facts[name] = random_value(rng, digits)
        lines.append(fact_line(name, facts[name]))
    pending = [n for n in names if n not in facts]
    for _ in range(rng.randint(5, 14)):
        lines.append(filler(rng, rng.randint(20, 160)))
        if pending and rng.random() < 0.3:
            name = pending.pop()
            facts[name] = random_value(rng, digits)
            lines.append(fact_line(name, facts[name]))
        for _ in range(rng.choice((1, 1, 2, 3))):  # checks of any earlier fact, near or far
            name = _pick(rng, sorted(facts))
            lines.append(query_prefix(name) + facts[name] + ".")
    for name in rng.sample(sorted(facts), min(2, len(facts))):
        lines.append(query_prefix(name) + facts[name] + ".")
    return "\n".join(lines)


SYLLABLES = "ka lo mi ru te za po ne vi su ba fe go hu ji ko ly ma ni or pe qu ri so tu ve wo xi yo ze".split()


def random_word(rng: random.Random) -> str:
    return "".join(_pick(rng, SYLLABLES) for _ in range(rng.randint(2, 3)))


def echo(rng: random.Random) -> str:
    """Each speaker says one random phrase; later lines repeat phrases by speaker. Nothing in a
    repeat is predictable except by finding the speaker's first line and copying it (induction)."""
    lines = [f"Echo drill {rng.randint(1, 999)}."]
    said: dict[str, str] = {}
    speakers = rng.sample(NAMES, rng.randint(3, 6))
    for _ in range(rng.randint(8, 16)):
        new = [n for n in speakers if n not in said]
        if new and (not said or rng.random() < 0.35):
            who = new[0]
            said[who] = f"{random_word(rng)} {random_word(rng)} {random_value(rng, 3)}"
            lines.append(f"{who} says: {said[who]}")
        else:
            who = _pick(rng, sorted(said))
            lines.append(f"{who} repeats: {said[who]}")
        if rng.random() < 0.3:
            lines.append(filler(rng, rng.randint(20, 100)))
    return "\n".join(lines)


GENERATORS = {"story": story, "dialogue": dialogue, "ledger": ledger, "echo": echo}

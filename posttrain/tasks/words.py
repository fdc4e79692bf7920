"""The closed vocabulary the built-in tasks draw from: short common words, names and objects.

Kept small and regular on purpose: the learner is a Llama of a few million parameters with a
~1-2k BPE vocabulary, so every word here should become one or two tokens after a short pretraining.
"""

from __future__ import annotations

import random

# Lowercase a-z only, 3-6 letters. Palindromes are removed below so "reverse the word" always changes it.
_RAW_WORDS = """
act add age air arm art ask bag bake ball band bank bath bean bear bed bell belt bike bird boat body
bone book boot bowl box boy bread brick bus cake calm camp card care cart cash chair chalk cheek chin
city clay cliff clock cloud coat coin cold cook corn cow crab crow cup dark deer desk dish door dove
drum duck dust ear east egg farm fern film fish flag flame floor flute fog food foot fork frog fruit
game gate gift girl glass glove goat gold grape grass hand hat hawk heart hill horse house ice ink
iron jam jar jelly juice kite king knee lake lamp leaf lemon lily lion lock loud lunch map mask meal
milk mint moon moth mouse mud nail neck nest net night north nose nut oak ocean oil olive onion owl
page paint park pear pen pig pink plant plate plum pond pot queen quilt rain river road robin rock
roof room rope rose ruby salt sand scarf seal seed sheep shell ship shoe silk sink sky sled slow snow
soap sock sofa song soup south spoon star stone storm sugar sun swan table tail tea tent tiger toast
tooth tower town toy train tree truck tulip vase wall wave west whale wheel wind wing wolf wood wool
yard yarn zebra acorn apple baker beach berry blue brown candy chess cider coral daisy dream eagle
fairy feast field glow green honey jewel koala maple melon music noble olive panda peach piano pilot
quiet radio raven robot salad shark smile spice sweet thumb tiger tulip umbra uncle vivid water zone
"""
WORDS: tuple[str, ...] = tuple(
    sorted(
        {w for w in _RAW_WORDS.split() if w.isalpha() and w.islower() and 3 <= len(w) <= 6 and w != w[::-1]}
    )
)

NAMES: tuple[str, ...] = ("Tom", "Ann", "Sam", "Lia", "Ben", "Eva", "Max", "Zoe", "Leo", "Mia")
# Countable things for word problems, in the plural.
THINGS: tuple[str, ...] = (
    "apples",
    "books",
    "coins",
    "pens",
    "cards",
    "eggs",
    "stamps",
    "shells",
    "cups",
    "toys",
)
JSON_KEYS: tuple[str, ...] = ("name", "color", "animal", "item", "word", "place")
PREFIXES: tuple[str, ...] = ("Answer:", "Result:", "Output:", "Note:")
COUNT_WORDS: dict[int, str] = {2: "two", 3: "three", 4: "four"}


def distinct_words(rng: random.Random, count: int) -> list[str]:
    """``count`` different words, none a substring of another.

    The substring rule keeps instruction-following checks unambiguous: a verifier that looks for
    ``cat`` as a substring and one that looks for it as a whole word must agree on every answer.
    """
    while True:
        chosen = rng.sample(WORDS, count)
        if not any(a != b and a in b for a in chosen for b in chosen):
            return chosen


def join_with_and(items: list[str]) -> str:
    """``a, b and c`` — the one list form every prompt uses."""
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]

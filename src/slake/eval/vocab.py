"""Word lists and random value makers for the synthetic tasks (our own lists)."""

from __future__ import annotations

import random
import string
import uuid

__all__ = [
    "ADJECTIVES",
    "NOUNS",
    "CITIES",
    "BASIC_WORDS",
    "word_keys",
    "random_number",
    "random_uuid",
    "random_word",
    "coded_word",
]

ADJECTIVES: tuple[str, ...] = tuple(
    """
    able absent acid agile alert amber ancient angry arctic ashen awake bald basic bitter blank
    bold brave brief bright brisk broad bronze calm candid cheap chilly civil clean clever close
    cloudy coarse cold cosmic crisp cruel curly damp dark dear deep dense dizzy dry dusty eager
    early earthy easy elder empty equal exact faint fair false famous fancy fast fierce final
    firm flat fluffy fond fragile free fresh frosty full funny gentle giant glad golden grand
    great green grim gritty happy hard harsh hasty heavy hidden hollow honest huge humble icy
    idle jolly keen kind large late lazy lean light little lively livid lone long loud loyal lucky
    mad magic major mellow merry mild minor misty modern moist muddy mute narrow neat nervous new
    nimble noble noisy odd old open orange pale plain polite poor proud pure purple quick quiet
    rapid rare raw ready red regal rich rigid ripe rosy rough round royal rude rusty sad safe
    salty sandy scarlet secret sharp shiny short shy silent silky silver simple sleepy slim slow
    small smart smooth snowy soft solid sour spare spicy stale steady steep sticky stiff stormy
    strange strict strong sunny super sweet swift tall tame tart tender thick thin tidy tiny
    tired tough tranquil ugly vast violet vivid warm weak wet white wide wild wise witty wooden
    young zany zealous
    """.split()
)

NOUNS: tuple[str, ...] = tuple(
    """
    acorn actor anchor angle apple apron arrow attic badge bakery ball banana banjo barn basket
    beach beard bell bench berry bicycle blanket bottle boulder bridge brook broom bucket button
    cabin cactus camel candle canoe canyon carpet castle cat cellar chair cherry chimney circus
    cliff clock cloud coat comet compass cookie copper cottage crayon cricket crown crystal cup
    daisy desert diamond dolphin donkey door dragon drum eagle engine falcon feather fence ferry
    fiddle field flag flute forest fountain fox garden garlic giraffe glacier glove goat grape
    guitar hammer harbor hat hawk helmet hill honey horse island jacket jar jungle kettle key
    kitten ladder lake lantern lemon lighthouse lion lizard magnet mango maple market meadow
    melon mirror monkey moon mountain mushroom needle nest oak ocean olive orchard otter owl
    paddle palace panda parrot peach pebble pencil pepper piano pillow pine planet plum pond
    pony potato pumpkin puzzle quilt rabbit radio raft rainbow raven ribbon river robot rocket
    saddle sailor salmon sandal scarf shadow shell ship shovel singer skate sled snail spoon
    squirrel stable star statue storm stove sugar sunset swan table teapot temple tiger tomato
    tower tractor trumpet tulip tunnel turtle umbrella valley vase violin wagon walnut walrus
    whale whistle willow window wizard wolf yacht zebra
    """.split()
)

CITIES: tuple[str, ...] = tuple(
    """
    Tokyo Paris Cairo Lima Oslo Nairobi Toronto Madrid Dublin Seoul Hanoi Lisbon Vienna Prague
    Santiago Athens Istanbul Mumbai Sydney Havana Bogota Jakarta Manila Warsaw Helsinki Quito
    Accra Dakar Montevideo Reykjavik Tbilisi Bangkok Caracas Kyoto Riga Zagreb Tunis Amman
    """.split()
)

#: A small vocabulary of common English words, used when no essay vocabulary is supplied.
BASIC_WORDS: tuple[str, ...] = tuple(dict.fromkeys(ADJECTIVES + NOUNS))


def word_keys(rng: random.Random, k: int, exclude: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """``k`` distinct ``adjective-noun`` keys, none in ``exclude``."""
    out: list[str] = []
    seen = set(exclude)
    total = len(ADJECTIVES) * len(NOUNS)
    if k > total - len(seen):
        raise ValueError(f"cannot draw {k} distinct word keys")
    while len(out) < k:
        key = random_word(rng)
        if key not in seen:
            seen.add(key)
            out.append(key)
    return out


def random_word(rng: random.Random) -> str:
    """A random ``adjective-noun`` compound."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def random_number(rng: random.Random, digits: int = 7) -> str:
    """A random number with exactly ``digits`` digits, as a string."""
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def random_uuid(rng: random.Random) -> str:
    """A random version-4 UUID string drawn from ``rng``."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def coded_word(rng: random.Random, low: int = 4, high: int = 6) -> str:
    """A random lowercase letter string of length in ``[low, high]``."""
    return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(low, high)))

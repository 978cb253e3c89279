"""Brown corpus tags -> the 12 universal POS tags of Petrov, Das and McDonald (2012).

Used by :mod:`gradflow.inputs.task_data` to build the ``brown-pos`` and ``brown-propn`` tasks.

Universal tags: NOUN VERB ADJ ADV PRON DET ADP NUM CONJ PRT X and ``.`` (punctuation).

A Brown tag is reduced to a *base tag* before mapping:

1. lower-case; a leading ``fw-`` (foreign word) is removed, so a foreign word gets the class of
   its underlying tag (``fw-in`` -> ADP);
2. compound tags (contractions such as ``pps+bez`` "it's", ``in+at`` "into the") keep their first
   part: the token is classed by its first word;
3. the decorations ``-tl`` (title), ``-hl`` (headline) and ``-nc`` (cited word) are stripped, also
   when repeated, and so is any other ``-x`` suffix of one or two letters (``in+at-t``,
   ``ppss+ber-n``, rare typos in the corpus);
4. a trailing ``*`` (negation: ``do*`` "don't", ``bedz*`` "wasn't") is removed; the bare tag
   ``*`` ("not", "n't") stays.

Choices where the Brown tagset does not match the universal one (following the conventions of
the universal tagset's Penn Treebank map, where ``not`` is RB -> ADV and ``everybody`` is NN):

- ``*`` (not, n't) -> ADV; ``ex`` (existential there) -> DET;
- ``cs`` (subordinating conjunction) -> ADP, as Penn's IN; ``cc`` -> CONJ;
- ``abl`` ``abn`` ``abx`` (pre-qualifiers and pre-quantifiers: quite, all, both) -> DET;
- ``ap`` (post-determiners: many, other, next, last, few) -> ADJ, as Penn tags them JJ;
- ``od`` (ordinal numeral) -> ADJ; ``cd`` -> NUM;
- ``nr`` (adverbial noun: home, today) and ``pn`` (nominal pronoun: everybody) -> NOUN;
- ``ql`` ``qlp`` ``wql`` (qualifiers: very, enough, how) -> ADV; ``rp`` and ``to`` -> PRT;
- ``uh`` (interjection) and ``nil`` (untagged) -> X.

Proper nouns (for the span task) are the base tags ``np``, ``nps``, ``np$`` and ``nps$``.
"""

from __future__ import annotations

import re

UNIVERSAL_TAGS: tuple[str, ...] = ("ADJ", "ADP", "ADV", "CONJ", "DET", "NOUN", "NUM", "PRON", "PRT", "VERB", "X", ".")

_GROUPS: dict[str, tuple[str, ...]] = {
    ".": (".", ",", ":", "(", ")", "--", "``", "''", "'"),
    "ADJ": ("jj", "jjr", "jjs", "jjt", "jj$", "od", "ap", "ap$"),
    "ADP": ("in", "cs"),
    "ADV": ("rb", "rbr", "rbt", "rn", "rb$", "ql", "qlp", "wql", "wrb", "*"),
    "CONJ": ("cc",),
    "DET": ("at", "abl", "abn", "abx", "dt", "dt$", "dti", "dts", "dtx", "ex", "wdt"),
    "NOUN": ("nn", "nns", "nn$", "nns$", "np", "nps", "np$", "nps$", "nr", "nrs", "nr$", "pn", "pn$"),
    "NUM": ("cd", "cd$"),
    "PRON": ("pp$", "pp$$", "ppl", "ppls", "ppo", "pps", "ppss", "wp$", "wpo", "wps"),
    "PRT": ("rp", "to"),
    "VERB": ("vb", "vbd", "vbg", "vbn", "vbz", "md", "be", "bed", "bedz", "beg", "bem", "ben", "ber", "bez",
             "do", "dod", "doz", "hv", "hvd", "hvg", "hvn", "hvz"),
    "X": ("uh", "nil"),
}
BASE_MAP: dict[str, str] = {tag: universal for universal, tags in _GROUPS.items() for tag in tags}
PROPER_NOUN_TAGS: frozenset[str] = frozenset({"np", "nps", "np$", "nps$"})

_SUFFIX = re.compile(r"-(?:tl|hl|nc|[a-z]{1,2})$")


def base_tag(tag: str) -> str:
    """The Brown base tag of a (possibly decorated or compound) tag, e.g. ``np-tl`` -> ``np``."""
    t = tag.lower()
    t = t.removeprefix("fw-")
    t = t.split("+", 1)[0]
    while (stripped := _SUFFIX.sub("", t)) != t and stripped:
        t = stripped
    if len(t) > 1 and t.endswith("*"):
        t = t[:-1]
    return t


def to_universal(tag: str) -> str:
    """The universal tag of a Brown tag; ``KeyError`` naming the tag and its base if it is unknown."""
    base = base_tag(tag)
    try:
        return BASE_MAP[base]
    except KeyError:
        raise KeyError(f"Brown tag {tag!r} (base {base!r}) has no universal mapping") from None


def is_proper_noun(tag: str) -> bool:
    """True for proper-noun tags (``np``, ``nps``, ``np$``, ``nps$``, decorated or compound)."""
    return base_tag(tag) in PROPER_NOUN_TAGS

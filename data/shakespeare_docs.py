"""The bundled Shakespeare sample corpus: how its texts become documents, and its train/val split.

Rebuild data/shakespeare/*.bin byte for byte with:  python data/tokenize_text.py --preset shakespeare --overwrite

Documents are kept near web-page size, like FineWeb's: plays are cut at their scene headings (an act
heading goes with the scene it introduces; a play's front matter goes with its first scene), poems
are cut between stanzas or numbered poems into pieces of about TARGET_CHARS characters. Documents
are exact slices of the texts, so joined back together they give each text unchanged. Whole works
are held out for validation, and both splits are shuffled with fixed seeds so that any prefix of
a split mixes many works.
"""

import random
import re
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
TEXTS_DIR = DATA_DIR / "shakespeare" / "texts"
OUT_DIR = DATA_DIR / "shakespeare"
PREFIX = "shakespeare"
# One tragedy, comedy, history, romance and narrative poem; about 9% of the tokens.
VAL_WORKS = ("lovers_complaint_gut.txt", "macbeth_gut.txt", "richard_ii_gut.txt", "tempest_gut.txt",
             "twelfth_night_gut.txt")
SHUFFLE_SEED = 1616  # the year Shakespeare died
TARGET_CHARS = 6000  # about 1,900 GPT-2 tokens of verse

# "ACT I.", "Act 2", "ACT FIRST": at the start of a line, capitalised as a heading (not "act" in prose).
ACT_RE = re.compile(r"(?:ACT|Act)\s+(?:[IVX]+\b|\d+\b|FIRST|SECOND|THIRD|FOURTH|FIFTH)")
# "Scene I. Elsinore.", "SCENE 2. Troy.", "ACT II. SCENE I." -- but not the setting line "SCENE: Britain".
SCENE_RE = re.compile(r"(?:(?:ACT|Act)\s+\S+\s+)?(?:SCENE|Scene)\s+(?:[IVXL]+\b|\d+\b)")
# A numbered poem's heading line: "XVII" or "IV."
NUMERAL_RE = re.compile(r"[ \t]*[IVXLC]+\.?[ \t]*")


class CorpusError(ValueError):
    """The bundled texts are missing or damaged."""


def _line_starts(text: str):
    """(offset, line) for every line of text."""
    pos = 0
    for line in text.splitlines(keepends=True):
        yield pos, line.rstrip("\r\n")
        pos += len(line)


def scene_cuts(text: str) -> list[int]:
    """Offsets where a play's documents start after the first one: each scene heading, or the act
    heading just before it; an act heading followed by other text (a prologue, a chorus) starts its own."""
    cuts = []
    act_pending = None  # offset of an act heading that nothing but blank lines has followed yet
    for offset, line in _line_starts(text):
        if SCENE_RE.match(line):
            cuts.append(act_pending if act_pending is not None else offset)
            act_pending = None
        elif ACT_RE.match(line):
            if act_pending is not None:
                cuts.append(act_pending)
            act_pending = offset
        elif line.strip() and act_pending is not None:
            cuts.append(act_pending)  # an act opening with a prologue: the act heading starts a document
            act_pending = None
    if act_pending is not None:
        cuts.append(act_pending)
    return cuts[1:]  # the front matter joins the first scene


def stanza_cuts(text: str) -> list[int]:
    """Offsets where a poem's documents start after the first one, about TARGET_CHARS apart: between
    numbered poems if the text has numeral headings, else between any stanzas."""
    starts = [m.end() for m in re.finditer(r"\n(?:[ \t]*\n)+", text) if m.end() < len(text)]
    numbered = [s for s in starts if NUMERAL_RE.fullmatch(text[s:].partition("\n")[0])]
    candidates = numbered if len(numbered) >= 2 else starts
    cuts, doc_start = [], 0
    for offset in candidates:
        if offset - doc_start >= TARGET_CHARS:
            cuts.append(offset)
            doc_start = offset
    return cuts


def split_work(text: str) -> list[str]:
    """A work's documents: exact, non-empty slices of text, in order."""
    cuts = scene_cuts(text)
    if len(cuts) < 2:  # no scene structure: a poem
        cuts = stanza_cuts(text)
    bounds = [0] + cuts + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def read_works(texts_dir: Path) -> dict[str, str]:
    """File name -> text, sorted by name."""
    files = sorted(texts_dir.glob("*.txt"))
    if not files:
        raise CorpusError(f"{texts_dir}: no .txt files; restore them with `git checkout -- {texts_dir}`")
    works = {}
    for f in files:
        try:
            works[f.name] = f.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise CorpusError(f"{f}: not valid UTF-8; restore it with `git checkout -- {f}`") from None
    missing = [w for w in VAL_WORKS if w not in works]
    if missing:
        raise CorpusError(f"{texts_dir}: validation works missing: {', '.join(missing)}")
    return works


def documents(texts_dir: Path = TEXTS_DIR) -> tuple[list[str], list[str]]:
    """(train documents, val documents), each list shuffled with its fixed seed."""
    works = read_works(Path(texts_dir))
    train, val = [], []
    for name, text in works.items():  # sorted by file name
        (val if name in VAL_WORKS else train).extend(split_work(text))
    random.Random(SHUFFLE_SEED).shuffle(train)
    random.Random(SHUFFLE_SEED + 1).shuffle(val)
    return train, val

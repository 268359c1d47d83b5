"""Word and n-gram statistics over plain text."""

import collections
import re

WORD_RE = re.compile(r"[A-Za-z0-9']+")
STOP_WORDS = frozenset("a an and are as at be by for from in is it of on or that the to was with".split())


def words(text, keep_stop_words=True):
    """Lower-case words of the text, apostrophes kept inside words."""
    found = [w.strip("'").lower() for w in WORD_RE.findall(text)]
    found = [w for w in found if w]
    if not keep_stop_words:
        found = [w for w in found if w not in STOP_WORDS]
    return found


def word_counts(text, keep_stop_words=True):
    """A Counter of words."""
    return collections.Counter(words(text, keep_stop_words=keep_stop_words))


def top_words(text, n=10, keep_stop_words=False):
    """The n most frequent words as (word, count), ties broken alphabetically."""
    counts = word_counts(text, keep_stop_words=keep_stop_words)
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:n]


def ngrams(text, n=2):
    """A Counter of word n-grams (tuples)."""
    if n < 1:
        raise ValueError("n must be at least 1")
    tokens = words(text)
    return collections.Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def line_stats(text):
    """Counts a reader of `wc` expects, plus the longest line's length."""
    lines = text.splitlines()
    return {
        "lines": len(lines),
        "words": len(text.split()),
        "chars": len(text),
        "longest_line": max((len(line) for line in lines), default=0),
    }

"""tally: small CSV tables and text statistics, standard library only."""

from tally.reader import read_csv, parse_value
from tally.table import Table
from tally.textstats import ngrams, top_words, word_counts
from tally.report import render_markdown, render_text

__all__ = ["Table", "read_csv", "parse_value", "ngrams", "top_words", "word_counts",
           "render_markdown", "render_text"]
__version__ = "0.3.0"

import unittest

from tally.textstats import line_stats, ngrams, top_words, word_counts, words


class TextStatsTest(unittest.TestCase):
    TEXT = "The cat and the hat. The cat's hat!\nA hat."

    def test_words(self):
        self.assertEqual(words("Don't stop, 'quoted' 42"), ["don't", "stop", "quoted", "42"])

    def test_word_counts(self):
        counts = word_counts(self.TEXT)
        self.assertEqual(counts["the"], 3)
        self.assertEqual(counts["hat"], 3)

    def test_top_words_drop_stop_words(self):
        self.assertEqual(top_words(self.TEXT, n=2), [("hat", 3), ("cat", 1)])

    def test_ngrams(self):
        pairs = ngrams("a b a b", n=2)
        self.assertEqual(pairs[("a", "b")], 2)
        self.assertEqual(pairs[("b", "a")], 1)
        with self.assertRaises(ValueError):
            ngrams("x", n=0)

    def test_line_stats(self):
        stats = line_stats("one two\nthree\n")
        self.assertEqual(stats, {"lines": 2, "words": 3, "chars": 14, "longest_line": 7})
        self.assertEqual(line_stats("")["longest_line"], 0)


if __name__ == "__main__":
    unittest.main()

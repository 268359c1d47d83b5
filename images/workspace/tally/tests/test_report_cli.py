import contextlib
import io
import os
import unittest

from tally.cli import main
from tally.report import render_markdown, render_text
from tally.table import Table

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


class ReportTest(unittest.TestCase):
    def test_render_text_alignment(self):
        table = Table(["name", "n"], [{"name": "a", "n": 5}, {"name": "bbb", "n": 10.5}])
        self.assertEqual(render_text(table), "name  n\n----  -----\na         5\nbbb   10.50\n")

    def test_render_markdown_escapes(self):
        table = Table(["k"], [{"k": "a|b"}, {"k": None}])
        self.assertEqual(render_markdown(table), "| k |\n| --- |\n| a\\|b |\n|  |\n")


class CliTest(unittest.TestCase):
    def run_cli(self, *argv):
        out = io.StringIO()
        code = main(list(argv), out=out)
        return code, out.getvalue()

    def test_summary(self):
        code, text = self.run_cli("summary", os.path.join(DATA, "sales.csv"), "--by", "region",
                                  "--sum", "amount")
        self.assertEqual(code, 0)
        lines = text.splitlines()
        self.assertTrue(lines[0].startswith("region"))
        self.assertIn("east", lines[2])
        self.assertIn("215.75", lines[2])

    def test_words(self):
        code, text = self.run_cli("words", os.path.join(DATA, "notes.txt"), "--top", "1")
        self.assertEqual((code, text), (0, "     2 gadget\n"))

    def test_missing_file(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code, _ = self.run_cli("wc", os.path.join(DATA, "absent.txt"))
        self.assertEqual(code, 1)
        self.assertIn("absent.txt", err.getvalue())


if __name__ == "__main__":
    unittest.main()

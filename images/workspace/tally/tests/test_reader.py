import os
import tempfile
import unittest

from tally.reader import parse_value, read_csv, read_rows


class ParseValueTest(unittest.TestCase):
    def test_numbers(self):
        self.assertEqual(parse_value("42"), 42)
        self.assertEqual(parse_value(" -7 "), -7)
        self.assertAlmostEqual(parse_value("3.5"), 3.5)

    def test_words(self):
        self.assertIs(parse_value("Yes"), True)
        self.assertIs(parse_value("false"), False)
        self.assertIsNone(parse_value("NA"))
        self.assertIsNone(parse_value(""))
        self.assertEqual(parse_value(" north "), "north")


class ReadRowsTest(unittest.TestCase):
    def test_header_and_rows(self):
        header, rows = read_rows("a,b\n1,x\n2,y\n")
        self.assertEqual(header, ["a", "b"])
        self.assertEqual(rows, [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}])

    def test_blank_lines_skipped(self):
        _, rows = read_rows("a\n1\n\n2\n")
        self.assertEqual([r["a"] for r in rows], [1, 2])

    def test_empty_text(self):
        self.assertEqual(read_rows(""), ([], []))

    def test_ragged_row_is_an_error(self):
        with self.assertRaisesRegex(ValueError, "line 3: expected 2 fields, got 1"):
            read_rows("a,b\n1,2\n3\n")

    def test_duplicate_header(self):
        with self.assertRaises(ValueError):
            read_rows("a,a\n1,2\n")

    def test_other_delimiter(self):
        _, rows = read_rows("a;b\n1;2\n", delimiter=";")
        self.assertEqual(rows, [{"a": 1, "b": 2}])


class ReadCsvTest(unittest.TestCase):
    def test_file(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t.csv")
            with open(path, "w", encoding="utf-8") as handle:
                handle.write("name,n\nx,1\ny,2\n")
            table = read_csv(path)
        self.assertEqual(table.columns, ["name", "n"])
        self.assertEqual(table.column("n"), [1, 2])

    def test_sample_data(self):
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        table = read_csv(os.path.join(here, "data", "sales.csv"))
        self.assertEqual(len(table), 8)
        self.assertIsNone(table.where(region="south", product="widget").column("amount")[0])


if __name__ == "__main__":
    unittest.main()

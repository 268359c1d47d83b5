import unittest

from tally.table import Table


def sample():
    return Table(["region", "amount", "units"], [
        {"region": "north", "amount": 10.0, "units": 1},
        {"region": "south", "amount": 5.0, "units": 2},
        {"region": "north", "amount": None, "units": 3},
        {"region": "east", "amount": 7.5, "units": 1},
    ])


class TableTest(unittest.TestCase):
    def test_missing_column_in_row(self):
        with self.assertRaises(KeyError):
            Table(["a", "b"], [{"a": 1}])

    def test_select_and_column(self):
        table = sample().select("units", "region")
        self.assertEqual(table.columns, ["units", "region"])
        self.assertEqual(table.column("units"), [1, 2, 3, 1])

    def test_unknown_column(self):
        with self.assertRaisesRegex(KeyError, "no column 'price'"):
            sample().column("price")

    def test_where(self):
        self.assertEqual(len(sample().where(region="north")), 2)
        self.assertEqual(len(sample().where(lambda r: r["units"] > 1)), 2)
        self.assertEqual(len(sample().where(lambda r: r["units"] > 1, region="south")), 1)

    def test_sort_none_first(self):
        table = sample().sort_by("amount")
        self.assertEqual(table.column("amount"), [None, 5.0, 7.5, 10.0])
        self.assertEqual(sample().sort_by("amount", reverse=True).column("amount")[0], 10.0)

    def test_add_column(self):
        table = sample().add_column("double", lambda r: r["units"] * 2)
        self.assertEqual(table.column("double"), [2, 4, 6, 2])
        with self.assertRaises(ValueError):
            table.add_column("units", lambda r: 0)

    def test_group_by(self):
        grouped = sample().group_by("region", total=("sum", "amount"), n=("count", "units"))
        by_region = {row["region"]: row for row in grouped}
        self.assertEqual(by_region["north"], {"region": "north", "total": 10.0, "n": 2})
        self.assertEqual(by_region["east"]["total"], 7.5)

    def test_group_by_mean_and_empty(self):
        table = Table(["k", "v"], [{"k": "a", "v": None}, {"k": "b", "v": 2}, {"k": "b", "v": 4}])
        grouped = {r["k"]: r["m"] for r in table.group_by("k", m=("mean", "v"))}
        self.assertEqual(grouped, {"a": None, "b": 3.0})

    def test_unknown_aggregate(self):
        with self.assertRaisesRegex(ValueError, "unknown aggregate"):
            sample().group_by("region", x=("mode", "units"))

    def test_to_csv(self):
        table = Table(["a", "b"], [{"a": None, "b": True}, {"a": 1.5, "b": "x,y"}])
        self.assertEqual(table.to_csv(), 'a,b\n,true\n1.5,"x,y"\n')

    def test_equality(self):
        self.assertEqual(sample(), sample())
        self.assertNotEqual(sample(), sample().select("region"))


if __name__ == "__main__":
    unittest.main()

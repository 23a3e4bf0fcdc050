import os
import sys
import tempfile
import unittest
from decimal import Decimal

sys.path.insert(0, "/srv/ledger")

from ledger import balances, parse_amount  # noqa: E402


class ParseAmount(unittest.TestCase):
    def test_plain(self):
        self.assertEqual(parse_amount("12.50"), Decimal("12.50"))
        self.assertEqual(parse_amount("-3"), Decimal("-3"))

    def test_separators_parentheses_and_spaces(self):
        self.assertEqual(parse_amount("2,500.00"), Decimal("2500.00"))
        self.assertEqual(parse_amount("(1200.00)"), Decimal("-1200.00"))
        self.assertEqual(parse_amount(" (1,000.5) "), Decimal("-1000.5"))
        self.assertIsInstance(parse_amount("1"), Decimal)

    def test_not_an_amount(self):
        for text in ("", "abc", "()", "1.2.3"):
            with self.assertRaises(ValueError, msg=text):
                parse_amount(text)


class Balances(unittest.TestCase):
    def test_journal_in_the_image(self):
        got = balances("/srv/ledger/journal.csv")
        self.assertEqual(got["checking"], Decimal("1234.91"))
        self.assertEqual(got["fees"], Decimal("15.00"))

    def test_sums_exactly(self):
        rows = "date,account,amount,memo\n" + "".join(f"2026-12-0{i % 9 + 1},cash,0.10,x\n" for i in range(10))
        rows += '2026-12-10,card,"(1,000.01)",y\n2026-12-11,card,0.01,z\n'
        with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
            f.write(rows)
        try:
            self.assertEqual(balances(f.name), {"cash": Decimal("1.00"), "card": Decimal("-1000.00")})
        finally:
            os.unlink(f.name)


if __name__ == "__main__":
    unittest.main()

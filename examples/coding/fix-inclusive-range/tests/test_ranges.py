import unittest

from ranges import inclusive_range


class InclusiveRange(unittest.TestCase):
    def test_includes_both_ends(self):
        self.assertEqual(inclusive_range(1, 4), [1, 2, 3, 4])

    def test_single(self):
        self.assertEqual(inclusive_range(7, 7), [7])

    def test_empty_when_reversed(self):
        self.assertEqual(inclusive_range(5, 3), [])

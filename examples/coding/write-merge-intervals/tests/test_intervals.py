import unittest

from intervals import merge


class Merge(unittest.TestCase):
    def test_overlapping(self):
        self.assertEqual(merge([(1, 3), (2, 6), (8, 10)]), [(1, 6), (8, 10)])

    def test_touching_and_unsorted(self):
        self.assertEqual(merge([(3, 5), (1, 3)]), [(1, 5)])

    def test_empty(self):
        self.assertEqual(merge([]), [])

import unittest

from words import count_words


class CountWords(unittest.TestCase):
    def test_newlines(self):
        self.assertEqual(count_words("one two\nthree"), 3)

    def test_double_spaces(self):
        self.assertEqual(count_words("a  b   c"), 3)

    def test_blank(self):
        self.assertEqual(count_words("  \n "), 0)

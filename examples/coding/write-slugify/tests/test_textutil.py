import unittest

from textutil import slugify


class Slugify(unittest.TestCase):
    def test_example(self):
        self.assertEqual(slugify("Hello, World!"), "hello-world")

    def test_runs_collapse(self):
        self.assertEqual(slugify("  a -- b__c  "), "a-b-c")

    def test_digits_kept(self):
        self.assertEqual(slugify("Python 3.11"), "python-3-11")

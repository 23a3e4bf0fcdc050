import unittest

from duration import parse_duration


class ParseDuration(unittest.TestCase):
    def test_hours_and_minutes(self):
        self.assertEqual(parse_duration("1h30m"), 5400)

    def test_minutes_and_seconds(self):
        self.assertEqual(parse_duration("2m5s"), 125)

    def test_seconds(self):
        self.assertEqual(parse_duration("45s"), 45)

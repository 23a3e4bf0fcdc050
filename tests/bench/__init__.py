"""Tests of bench/run_all.py and bench/render.py."""

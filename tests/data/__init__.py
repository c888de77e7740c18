"""Tests of library/data."""

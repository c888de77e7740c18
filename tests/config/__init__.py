"""Tests of library/config."""

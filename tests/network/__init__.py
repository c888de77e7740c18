"""Tests of library/network."""

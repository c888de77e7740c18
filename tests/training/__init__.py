"""Tests of library/training."""

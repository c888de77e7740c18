"""Tests of library/memory."""

"""Tests of library/monitoring."""

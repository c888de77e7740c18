"""Tests of the digits base models and their judge (library/digits, models/digits-*)."""

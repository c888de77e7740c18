"""Tests that run the benchmarks in bench/ on the tiny models."""

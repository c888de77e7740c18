"""Tests of library/families: one module per family, the registry, the objectives, the tiny builders."""

"""`python -m library.models.tiny` is the tiny-model builder's other name (library.families.tiny); each family's
model code lives in its package under library/families."""

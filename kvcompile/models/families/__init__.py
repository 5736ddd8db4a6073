"""One module per model family, each declaring a `FAMILY` (models/family.py); the table
that finds them is models/registry.py."""

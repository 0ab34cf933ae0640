"""The formats the report reads, one module per family (see recipes/report/parse.py, their one interface)."""

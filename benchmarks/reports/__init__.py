"""What the commands print and write: curves, tables, the JSON reports."""

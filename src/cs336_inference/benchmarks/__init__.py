"""One module per `python -m cs336_inference bench NAME`; each prints a table and writes
`figures/NAME.json` + PNGs. Shared timing helpers live in `cs336_inference.timing`.
"""

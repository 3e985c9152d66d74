"""One module per `python -m cs336_inference bench NAME` (`quantization` and `speculative` also declare
a sibling, whose own module only points there), each through the scaffold in `base`: a table, then
`figures/NAME.json` + PNGs. Shared timing helpers live in `cs336_inference.timing`.
"""

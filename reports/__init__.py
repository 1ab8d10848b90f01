"""Report rendering (PNG plots with matplotlib, self-contained HTML) and Chrome traces.

Generated reports are written where the user asks (``--out DIR``); committed examples
live in sub-folders here.
"""

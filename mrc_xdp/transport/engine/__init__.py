"""The transport engine's C sources (engine.c, engine.h) and its cffi builder (build.py).

The compiled module is mrc_xdp.transport._engine; use it through mrc_xdp.transport.
"""

"""The library's version (``pisa.__version__``, ``pisa --version``); imports nothing, so every part
of the library may read it."""
__version__ = "0.1.0"

"""Pieces shared by every op: configuration and checks (``config``), pyramid geometry
(``geometry``), selections transposed by block (``csr``), Triton primitives (``op``)."""

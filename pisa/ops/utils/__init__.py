"""Pieces shared by every op: configuration and checks (``config``), pyramid geometry
(``geometry``), selections transposed by block (``csr``), Triton primitives (``op``), how kernels
take their arguments and the constants they share (``triton_utils``), and the kernels' public
launch knobs (``launch``)."""

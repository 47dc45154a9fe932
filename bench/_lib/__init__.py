"""The benchmarks' shared pieces: rounds and tables (``common``), the raw gRPC floors
(``floors``, ``step_floor``, ``open_floor``, ``server_floor``) and the reference-package
server (``foreign_server``). The benchmarks people run are the modules of ``bench/``."""

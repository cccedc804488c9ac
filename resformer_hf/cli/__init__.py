"""The command-line layer: `resformer-convert`, `resformer-quickstart`, `resformer-analyze` and `resformer-serve`.

The only place that parses arguments. Each command turns its flags into plain typed arguments of a library function
and runs it under `common.run_command`, which gives them all one error contract. Importing this package is cheap
(stdlib only): `startup` is imported first of all by `resformer_hf/__init__.py`.
"""

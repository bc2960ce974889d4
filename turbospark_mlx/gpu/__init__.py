"""The GPU kernels: one module per op beside its `_ref` twin in `turbospark_mlx.quant.reference`.

`backend.py` chooses metal, cuda or reference in one place; `build.py` turns the dialect
sources in `kernels/` into MLX kernel objects; `quantize.py`, `decode.py` and
`decode_mma.py` are the ops; `inspect.py` renders the exact sources for CI's compile checks.
"""

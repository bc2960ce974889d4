"""`python -m turbospark_mlx ...`: the `turbospark-mlx` command line."""

import sys

from .cli import main

sys.exit(main())

"""Model families. One file per HF `model_type`, read top to bottom like mlx-lm's."""

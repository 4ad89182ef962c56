"""Pipeline schedules as data (pure Python: needs neither JAX, Ray nor CuPy)."""

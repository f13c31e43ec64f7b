"""Small integer helpers shared by the HAL, the model core and the kernels."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers: the number of ``b``-sized blocks covering ``a`` (b > 0)."""
    return -(-a // b)

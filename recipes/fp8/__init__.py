from recipes.fp8.convert import convert_to_fp8
from recipes.fp8.linear import fp8_amaxes_finite, non_finite_amaxes, update_fp8_scaling

__all__ = ["convert_to_fp8", "fp8_amaxes_finite", "non_finite_amaxes", "update_fp8_scaling"]

from recipes.fp8.convert import convert_to_fp8
from recipes.fp8.training import update_fp8_scaling

__all__ = ["convert_to_fp8", "update_fp8_scaling"]

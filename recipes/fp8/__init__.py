from recipes.fp8.convert import convert_to_fp8

__all__ = ["convert_to_fp8"]

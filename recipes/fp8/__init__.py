from recipes.fp8.convert import check_recipe_implemented, convert_to_fp8

__all__ = ["check_recipe_implemented", "convert_to_fp8"]

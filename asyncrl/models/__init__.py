"""Models asyncrl builds locally: the tiny default (tiny.py) and one config per family (families.py)."""

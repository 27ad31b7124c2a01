"""Functions that lesson 10's tests run on spawned ranks (importable by their dotted name)."""

"""Lowest layer: errors, deadlines, authentication primitives. Imports nothing from tdist."""

"""YAML presets and sweep definitions, installed as ``kvquant.configs`` (package data).

Find them with ``importlib.resources.files("kvquant.configs") / "presets"``.
"""

"""The Megatron training layer around the mlp_offload engine.

Sub-packages, each importing only those before it (tests/unit/test_layout.py checks it):
``errors`` (user errors, flag value types) -> ``runtime`` -> ``model`` -> ``data`` -> ``checkpoint``
-> ``offload`` -> ``metrics`` -> ``args`` -> the loop: ``training`` (readable top to bottom) and
``initialize``. Each sub-package's docstring says what lives there.
"""

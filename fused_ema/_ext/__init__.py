"""The compiled extension's Python side (the bottom layer): loading fused_ema._C, the C++ helpers
it provides to every other layer, and the test-only operators (testing.py). Imports nothing else
from fused_ema."""

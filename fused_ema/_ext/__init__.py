"""The compiled extension's Python side (the bottom layer): loading fused_ema._C and the C++
helpers it provides to every other layer. Imports nothing else from fused_ema."""

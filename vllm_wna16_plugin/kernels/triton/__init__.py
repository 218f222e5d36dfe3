"""The plugin's Triton fused-MoE WNA16 kernel (`fused_moe.py`), its shared dequant
helpers (`dequant.py`), launch configs (`configs.py`) and the TD decision (`td_gate.py`).

Importing this package does not import Triton kernels; import the modules you need.
"""

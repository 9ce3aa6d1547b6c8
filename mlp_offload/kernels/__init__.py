"""The update's arithmetic, both sides: torch's AdamW kernels and the fp32 working copies (``update``),
16-bit master remainders (``remainders``), the device's one-pass Triton kernel (``fused_update``) and the
CPU's one-pass C++ kernel (``cpu_one_pass``, its source in ``cpu_one_pass_source``); Adam moments in
8 bits with block scales (``blockwise8``: formats, block layout, the torch path; its one-pass twins
``blockwise8_cpu`` and ``blockwise8_device``). May import torch and each other only: the engine's other
modules import these."""
